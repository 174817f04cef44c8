//! kvroute as an Envoy dynamic module (`libkvroute_dynmod.so`) in real Envoy 1.40: the ABI
//! it declares exists in that Envoy, routing in both modes after a pushed snapshot, the
//! filter's own error replies, in-flight accounting back to zero, metrics in `/stats`, a bad
//! config refused, and a panic failing open. `make test-dynmod` builds the module and runs
//! these; run by hand, set `KVROUTE_DYNMOD_DIR` (or build with `make dynmod`).
//!
//! Envoy finds the module through `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`, which the harness sets
//! to [`dynmod_dir`] for every Envoy it starts; [`setup`] adds `KVROUTE_DYNMOD_TEST_PANIC=1`
//! (the module's test knob: a request with `x-kvroute-test-panic` panics inside the hook;
//! with the value `next-stream`, the next routing stream's creation panics instead).

use kvroute_core::snapshot::{EndpointStats, Snapshot};
use kvroute_integration::harness::http::Response;
use kvroute_integration::harness::kvroute::{
    chat, example_config, logged_decision, now_ms, push_to_example, routed_to, Fleet, FleetMode,
    FleetOptions,
};
use kvroute_integration::harness::{dynmod_dir, envoy_binary, workspace_root};
use kvroute_integration::harness::{Envoy, RecordingBackend, Reply};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

fn module() -> PathBuf {
    dynmod_dir().join("libkvroute_dynmod.so")
}

/// Check the module is built, and arm its test knob for the Envoys these tests start (same
/// value from every test; the harness points Envoy at [`dynmod_dir`]).
fn setup() {
    assert!(
        module().is_file(),
        "{} missing: run `make dynmod`",
        module().display()
    );
    std::env::set_var("KVROUTE_DYNMOD_TEST_PANIC", "1");
}

fn dynmod(opts: FleetOptions) -> FleetOptions {
    FleetOptions {
        dynmod: true,
        ..opts
    }
}

/// `nm -D <flags> <file>`: the symbol names (empty when nm fails).
fn nm(flags: &[&str], file: &std::path::Path) -> std::io::Result<BTreeSet<String>> {
    let out = Command::new("nm")
        .arg("-D")
        .args(flags)
        .arg(file)
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last().map(str::to_owned))
        .collect())
}

#[test]
fn callbacks_are_exported_by_envoy() {
    setup();
    let envoy = nm(&["--defined-only"], &envoy_binary().unwrap()).unwrap();
    let exported: BTreeSet<&String> = envoy
        .iter()
        .filter(|s| s.starts_with("envoy_dynamic_module_callback_"))
        .collect();
    assert!(exported.len() > 700, "{} callbacks", exported.len());
    // Every callback declared in the ABI module...
    let src = std::fs::read_to_string(workspace_root().join("dynmod/src/abi.rs")).unwrap();
    let declared: BTreeSet<String> = src
        .split("fn envoy_dynamic_module_callback_")
        .skip(1)
        .filter_map(|rest| {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            (!name.is_empty()).then(|| format!("envoy_dynamic_module_callback_{name}"))
        })
        .collect();
    assert!(declared.len() >= 20, "{declared:?}");
    let missing: Vec<_> = declared.iter().filter(|d| !envoy.contains(*d)).collect();
    assert!(
        missing.is_empty(),
        "declared, not exported by Envoy: {missing:?}"
    );
    // ...and every symbol the built module needs from Envoy.
    let needed: Vec<String> = nm(&["--undefined-only"], &module())
        .unwrap()
        .into_iter()
        .filter(|s| s.starts_with("envoy_"))
        .collect();
    assert!(!needed.is_empty());
    let missing: Vec<_> = needed.iter().filter(|d| !envoy.contains(*d)).collect();
    assert!(
        missing.is_empty(),
        "needed by the module, not in Envoy: {missing:?}"
    );
    for n in &needed {
        assert!(declared.contains(n), "{n} used but not declared in abi.rs");
    }
}

#[tokio::test]
async fn cluster_mode_routes_after_snapshot_and_settles() {
    setup();
    let fleet = Fleet::start(dynmod(FleetOptions::least_kv()))
        .await
        .unwrap();
    // No snapshot yet: fail open to the default route.
    let r = fleet
        .post("/v1/chat/completions", &chat("hello"))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(fleet.custom("kvroute.fail_open").await.unwrap(), 1);

    fleet.push_usages(1, &[0.9, 0.1]).await.unwrap();
    for _ in 0..4 {
        let r = fleet
            .post("/v1/chat/completions", &chat("route me"))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-backend"), Some("b1"), "least KV usage is e1");
    }
    let rec = fleet.backends[1].requests().pop().unwrap();
    assert_eq!(rec.header("x-kvroute-cluster"), Some("c1"));
    assert_eq!(rec.body.as_ref(), chat("route me").as_slice());
    // Metrics in Envoy's /stats: the Wasm filter's names, in the dynamic-module namespace.
    assert_eq!(fleet.custom("kvroute.decisions.policy").await.unwrap(), 4);
    assert_eq!(
        fleet
            .custom("kvroute.decisions.by_policy.least_kv")
            .await
            .unwrap(),
        4
    );
    assert_eq!(
        fleet.custom("kvroute.snapshots.published").await.unwrap(),
        1
    );
    let stats = fleet.envoy.stats().await.unwrap();
    assert!(
        stats.contains_key("dynamicmodulescustom.kvroute.inflight"),
        "{:?}",
        stats
            .keys()
            .filter(|k| k.contains("kvroute"))
            .collect::<Vec<_>>()
    );
    // Every reservation released, none held.
    assert_eq!(fleet.settled_reservations().await.unwrap(), 4);
    let mut envoy = fleet.envoy;
    assert!(envoy.is_running());
}

#[tokio::test]
async fn endpoint_mode_sets_the_destination_endpoint() {
    setup();
    let fleet = Fleet::start(dynmod(FleetOptions {
        mode: FleetMode::OverrideHost,
        ..FleetOptions::least_kv()
    }))
    .await
    .unwrap();
    fleet.push_usages(1, &[0.05, 0.9]).await.unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("to e0"))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-backend"), Some("b0"));
    let rec = fleet.backends[0].requests().pop().unwrap();
    let header = rec.header("x-gateway-destination-endpoint").unwrap_or("");
    assert_eq!(
        header.split(',').next(),
        Some(fleet.backends[0].address().as_str()),
        "{header}"
    );
    assert_eq!(fleet.settled_reservations().await.unwrap(), 1);
}

#[tokio::test]
async fn error_replies_are_the_filters() {
    let fleet = least_kv_fleet(&[0.2, 0.3]).await.unwrap();
    // A body that is not JSON: routed by load alone and counted, as by the Wasm filter.
    let r = fleet
        .post("/v1/chat/completions", b"not json at all")
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(fleet.custom("kvroute.parse_errors").await.unwrap(), 1);
    // A model no endpoint serves: the filter's OpenAI-shaped 404.
    let body = serde_json::json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]});
    let r = fleet
        .post("/v1/chat/completions", body.to_string().as_bytes())
        .await
        .unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(r.body.as_ref()).unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], "model");
    assert_eq!(
        fleet
            .custom("kvroute.outcome.model_not_found")
            .await
            .unwrap(),
        1
    );
    // A malformed snapshot on the ingest listener: the ingest role's 400.
    let r = fleet
        .ingest(
            b"{not a snapshot",
            Some(kvroute_integration::harness::kvroute::TEST_TOKEN),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(r.body.as_ref()).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // A wrong token: 401.
    let r = fleet
        .ingest(b"{}", Some("wrong-token-0123456789"))
        .await
        .unwrap();
    assert_eq!(r.status, 401, "{}", r.text());
    // Nothing reached a backend but the one routed request.
    assert_eq!(fleet.counts().iter().sum::<usize>(), 1);
}

#[tokio::test]
async fn a_bad_config_is_refused_with_a_clear_line() {
    setup();
    let err = Fleet::start(dynmod(FleetOptions {
        route_config: r#""picker":{"policy":"no_such_policy"}"#.into(),
        ..FleetOptions::default()
    }))
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("kvroute plugin config"), "{err}");
    assert!(err.contains("no_such_policy"), "{err}");
}

/// A least-KV fleet on the native module (test knob armed), with one snapshot pushed:
/// backend `i` at KV usage `usages[i]` (0..1).
async fn least_kv_fleet(usages: &[f64]) -> anyhow::Result<Fleet> {
    setup();
    let fleet = Fleet::start(dynmod(FleetOptions::least_kv())).await?;
    fleet.push_usages(1, usages).await?;
    Ok(fleet)
}

/// POST a chat body with `headers` (and `content-type`) to the fleet's Envoy; asserts a 200.
async fn post_chat(
    fleet: &Fleet,
    headers: &[(&str, &str)],
    text: &str,
) -> anyhow::Result<Response> {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let r = kvroute_integration::harness::http::request(
        "POST",
        &fleet.url("/v1/chat/completions"),
        &h,
        &chat(text),
    )
    .await?;
    assert_eq!(r.status, 200, "{}", r.text());
    Ok(r)
}

/// The client's routing headers on the requests named `named 0` to `named 3`.
const NAMING: [(&str, &str); 2] = [
    ("x-kvroute-cluster", "c0"),
    ("x-kvroute-decision", "forged"),
];

/// The four `named i` requests, sent with [`NAMING`], went unrouted: none reached a backend
/// with those headers, and the default route's round robin spread them over both backends
/// instead of sending them all to the named c0.
fn assert_named_went_to_the_default_route(fleet: &Fleet) {
    let named = |b: &RecordingBackend| {
        b.requests()
            .into_iter()
            .filter(|r| String::from_utf8_lossy(&r.body).contains("named "))
            .collect::<Vec<_>>()
    };
    let all: Vec<_> = fleet.backends.iter().flat_map(named).collect();
    assert_eq!(all.len(), 4);
    for r in &all {
        assert_eq!(r.header("x-kvroute-cluster"), None);
        assert_eq!(r.header("x-kvroute-decision"), None);
    }
    let to_b1 = fleet.backends.get(1).map_or(0, |b| named(b).len());
    assert!((1..4).contains(&to_b1), "{to_b1} of 4 on b1");
}

/// A request with more headers than the module reads on the stack (40 of its own, then a
/// forged routing header after them): the filter still sees every one. The forged cluster
/// is replaced by its decision (least KV: c1), and the other headers reach the backend.
#[tokio::test]
async fn a_request_with_many_headers_is_read_whole() -> anyhow::Result<()> {
    let fleet = least_kv_fleet(&[0.9, 0.1]).await?;
    let names: Vec<String> = (0..40).map(|i| format!("x-extra-{i:02}")).collect();
    let mut headers: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "v")).collect();
    headers.push(("x-kvroute-cluster", "c0"));
    let r = post_chat(&fleet, &headers, "many headers").await?;
    assert_eq!(r.header("x-backend"), Some("b1"));
    let rec = fleet.backends[1]
        .requests()
        .pop()
        .ok_or_else(|| anyhow::anyhow!("b1 got no request"))?;
    assert_eq!(rec.header("x-kvroute-cluster"), Some("c1"));
    assert_eq!(rec.header("x-extra-00"), Some("v"));
    assert_eq!(rec.header("x-extra-39"), Some("v"));
    assert!(fleet.backends[0].requests().is_empty());
    Ok(())
}

/// One worker reads every request body into the same buffer (bodies up to 64 KiB; a larger
/// one into its own): each body is read alone, whatever came before it. A short body naming
/// a model no endpoint serves, after a 40 KB one, gets the filter's 404 (with the longer
/// body's bytes left behind it, it would not parse and would be routed by load); a body past
/// the kept size, then a short one, are both routed by the policy (least KV: b1); no body
/// failed to parse.
#[tokio::test]
async fn bodies_of_any_size_in_turn_are_each_read_alone() -> anyhow::Result<()> {
    let fleet = least_kv_fleet(&[0.9, 0.1]).await?;
    post_chat(&fleet, &[], &"a long prompt. ".repeat(2_700)).await?;
    let body = serde_json::json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]});
    let r = fleet
        .post("/v1/chat/completions", body.to_string().as_bytes())
        .await?;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = post_chat(&fleet, &[], &"past the kept size. ".repeat(15_000)).await?;
    assert_eq!(r.header("x-backend"), Some("b1"));
    let r = post_chat(&fleet, &[], "short").await?;
    assert_eq!(r.header("x-backend"), Some("b1"));
    assert_eq!(fleet.custom("kvroute.parse_errors").await?, 0);
    assert_eq!(fleet.custom("kvroute.decisions.load_only").await?, 0);
    Ok(())
}

/// After the panics: the next request is routed as usual (least KV: b1), Envoy still up.
async fn assert_routed_after(fleet: Fleet) -> anyhow::Result<()> {
    let r = fleet.post("/v1/chat/completions", &chat("after")).await?;
    assert_eq!(r.header("x-backend"), Some("b1"));
    let mut envoy = fleet.envoy;
    assert!(envoy.is_running());
    Ok(())
}

#[tokio::test]
async fn a_panic_fails_open_and_envoy_lives() {
    let fleet = least_kv_fleet(&[0.9, 0.1]).await.unwrap();
    // Unrouted: the default route (round robin over both), never a kvroute decision.
    post_chat(&fleet, &[("x-kvroute-test-panic", "1")], "panic")
        .await
        .unwrap();
    assert_eq!(fleet.custom("kvroute.fail_open").await.unwrap(), 1);
    assert!(fleet.log_tail(200).contains("panic caught"));
    // A client naming its own backend while the hook panics (before the stream's own
    // removal of the routing headers) does not get it: the headers go, and the default
    // route's round robin reaches both backends (found by a breaker: all four went to c0).
    for i in 0..4 {
        let mut h = vec![("x-kvroute-test-panic", "1")];
        h.extend_from_slice(&NAMING);
        post_chat(&fleet, &h, &format!("named {i}")).await.unwrap();
    }
    assert_eq!(fleet.custom("kvroute.fail_open").await.unwrap(), 5);
    assert_named_went_to_the_default_route(&fleet);
    assert_routed_after(fleet).await.unwrap();
}

/// A stream whose creation panicked (`HttpFilter::unrouted`, the `x-kvroute-test-panic:
/// next-stream` knob: the arming request goes on, the next routing stream's creation
/// panics) routes nothing: its request takes the default route, without the routing
/// headers a client sent (else a client could name its backend whenever stream creation
/// fails), and counts as a fail-open. Streams after it are routed as usual.
#[tokio::test]
async fn a_stream_whose_creation_panicked_goes_unrouted_without_client_routing() {
    let fleet = least_kv_fleet(&[0.9, 0.1]).await.unwrap();
    for i in 0..4 {
        // The arming request itself is routed (least KV: b1).
        let r = post_chat(
            &fleet,
            &[("x-kvroute-test-panic", "next-stream")],
            &format!("arm {i}"),
        )
        .await
        .unwrap();
        assert_eq!(r.header("x-backend"), Some("b1"));
        post_chat(&fleet, &NAMING, &format!("named {i}"))
            .await
            .unwrap();
    }
    assert_eq!(fleet.custom("kvroute.fail_open").await.unwrap(), 4);
    assert!(fleet.log_tail(200).contains("in a stream's creation"));
    assert_named_went_to_the_default_route(&fleet);
    assert_routed_after(fleet).await.unwrap();
}

/// The shipped example (`examples/envoy/dynamic-module/cluster-mode.yaml`, only its ports
/// and model-server addresses rewritten) routes by its pushed snapshot, and its access log
/// line carries the decision record (filter state `wasm.kvroute_decision`, the key the Wasm
/// filter sets): policy, chosen endpoint, both candidates ranked, the chosen one first.
#[tokio::test]
async fn the_example_routes_and_logs_its_decisions() -> anyhow::Result<()> {
    setup();
    let b = [
        RecordingBackend::start("b0", Reply::default()).await?,
        RecordingBackend::start("b1", Reply::default()).await?,
    ];
    let addrs: Vec<String> = b.iter().map(RecordingBackend::address).collect();
    let (envoy, [listen, ingest]) = Envoy::start_on_free_ports(1, |[listen, ingest]| {
        example_config("dynamic-module/cluster-mode.yaml", listen, ingest, &addrs)
    })
    .await?;
    let now = now_ms();
    let eps = addrs
        .iter()
        .zip([("vllm-a", 0.9), ("vllm-b", 0.1)])
        .enumerate()
        .map(|(i, (a, (cluster, kv)))| EndpointStats {
            id: format!("pool/{cluster}"),
            address: a.clone(),
            cluster: cluster.into(),
            kv_usage: Some(kv),
            ..EndpointStats::fixture(i, now)
        })
        .collect();
    push_to_example(ingest, &Snapshot::new(1, now, eps)).await?;
    assert_eq!(
        routed_to(listen).await?,
        "b1",
        "the endpoint with KV headroom"
    );
    let record = logged_decision(&envoy).await?;
    assert!(
        record.starts_with("policy:hybrid;endpoint=pool/vllm-b;"),
        "{record}"
    );
    let top = record
        .split_once(";top=")
        .map(|(_, t)| t)
        .ok_or_else(|| anyhow::anyhow!("no candidates: {record}"))?;
    assert!(top.starts_with("pool/vllm-b[score="), "{record}");
    assert_eq!(top.matches("[score=").count(), 2, "{record}");
    Ok(())
}

#[test]
fn example_config_validates() {
    setup();
    let f = workspace_root().join("examples/envoy/dynamic-module/cluster-mode.yaml");
    kvroute_integration::harness::Envoy::validate(&f).unwrap();
}
