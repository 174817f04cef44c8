//! The Istio example is complete and paired:
//! - `examples/istio/kvroute-envoyfilter.yaml`'s patches, applied with Istio's EnvoyFilter semantics
//!   to a representative gateway configuration (`examples/istio/testdata/gateway-bootstrap.yaml`),
//!   give a config that `envoy --mode validate` accepts, with the filter before the router,
//!   `allow_on_headers_stop_iteration`, the ingest listener on the pod IP, the override_host
//!   policy on the pool's cluster and the retry policy on the `llm` route;
//! - every patch matches something in that configuration (a patch that matches nothing is
//!   silently ignored by Istio, so a typo would ship a gateway that never acts on kvroute);
//! - the pieces agree across files: ingest port, token, gateway selector, cluster name.
//!
//! EnvoyFilter semantics applied (<https://istio.io/latest/docs/reference/config/networking/envoy-filter/>):
//! LISTENER ADD appends; LISTENER/CLUSTER/HTTP_ROUTE MERGE is a protobuf merge (messages
//! merge field by field, repeated fields append, scalars replace); HTTP_FILTER INSERT_BEFORE
//! inserts before the named sub-filter of the matched network filter. Gateway cluster names
//! are `outbound|<port>||<service FQDN>`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_integration::harness::{wasm_path, workspace_root, Envoy};
use serde_json::{json, Value};

fn yaml_docs(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(workspace_root().join(path)).unwrap();
    text.split("\n---\n")
        .map(|d| serde_yaml_ng::from_str::<Value>(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn kind<'a>(docs: &'a [Value], k: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == k)
        .unwrap_or_else(|| panic!("no {k}"))
}

/// Protobuf merge of JSON-mapped messages.
fn merge(into: &mut Value, from: &Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get_mut(k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        a.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => a.extend(b.iter().cloned()),
        (slot, v) => *slot = v.clone(),
    }
}

fn port_of(listener: &Value) -> Option<u64> {
    listener["address"]["socket_address"]["port_value"].as_u64()
}

/// Apply every patch; returns, per patch, how many places it changed.
fn apply(cfg: &mut Value, patches: &[Value]) -> Vec<usize> {
    let mut counts = Vec::new();
    for p in patches {
        let (to, op) = (
            p["applyTo"].as_str().unwrap(),
            p["patch"]["operation"].as_str().unwrap(),
        );
        let m = &p["match"];
        assert_eq!(m["context"], "GATEWAY", "patches target the gateway");
        let value = &p["patch"]["value"];
        let mut n = 0;
        let res = &mut cfg["static_resources"];
        match (to, op) {
            ("LISTENER", "ADD") => {
                res["listeners"].as_array_mut().unwrap().push(value.clone());
                n += 1;
            }
            ("LISTENER", "MERGE") => {
                for l in res["listeners"].as_array_mut().unwrap() {
                    if port_of(l) == m["listener"]["portNumber"].as_u64() {
                        merge(l, value);
                        n += 1;
                    }
                }
            }
            ("HTTP_FILTER", "INSERT_BEFORE") => {
                let fc = &m["listener"]["filterChain"]["filter"];
                for l in res["listeners"].as_array_mut().unwrap() {
                    if m["listener"]["portNumber"].is_u64()
                        && port_of(l) != m["listener"]["portNumber"].as_u64()
                    {
                        continue;
                    }
                    for chain in l["filter_chains"].as_array_mut().unwrap() {
                        for f in chain["filters"].as_array_mut().unwrap() {
                            if f["name"] != fc["name"] {
                                continue;
                            }
                            let hf = f["typed_config"]["http_filters"].as_array_mut().unwrap();
                            if let Some(i) =
                                hf.iter().position(|h| h["name"] == fc["subFilter"]["name"])
                            {
                                hf.insert(i, value.clone());
                                n += 1;
                            }
                        }
                    }
                }
            }
            ("CLUSTER", "MERGE") => {
                let name = format!(
                    "outbound|{}||{}",
                    m["cluster"]["portNumber"],
                    m["cluster"]["service"].as_str().unwrap()
                );
                for c in res["clusters"].as_array_mut().unwrap() {
                    if c["name"] == name.as_str() {
                        merge(c, value);
                        n += 1;
                    }
                }
            }
            ("HTTP_ROUTE", "MERGE") => {
                let want = &m["routeConfiguration"]["vhost"]["route"]["name"];
                for l in res["listeners"].as_array_mut().unwrap() {
                    for chain in l["filter_chains"].as_array_mut().unwrap() {
                        for f in chain["filters"].as_array_mut().unwrap() {
                            let Some(vhosts) =
                                f["typed_config"]["route_config"]["virtual_hosts"].as_array_mut()
                            else {
                                continue;
                            };
                            for vh in vhosts {
                                for r in vh["routes"].as_array_mut().unwrap() {
                                    if &r["name"] == want {
                                        merge(r, value);
                                        n += 1;
                                    }
                                }
                            }
                        }
                    }
                }
            }
            ("ROUTE_CONFIGURATION", "MERGE") => {
                let port = m["routeConfiguration"]["portNumber"].as_u64();
                for l in res["listeners"].as_array_mut().unwrap() {
                    if port_of(l) != port {
                        continue;
                    }
                    for chain in l["filter_chains"].as_array_mut().unwrap() {
                        for f in chain["filters"].as_array_mut().unwrap() {
                            // `get_mut`: indexing would add `route_config: null` elsewhere.
                            let rc = f
                                .get_mut("typed_config")
                                .and_then(|t| t.get_mut("route_config"))
                                .filter(|rc| rc.is_object());
                            if let Some(rc) = rc {
                                merge(rc, value);
                                n += 1;
                            }
                        }
                    }
                }
            }
            other => panic!("patch kind {other:?} not handled by this test"),
        }
        counts.push(n);
    }
    counts
}

#[test]
fn envoyfilter_patches_apply_to_a_gateway_and_validate() {
    let filter = yaml_docs("examples/istio/kvroute-envoyfilter.yaml");
    let ef = kind(&filter, "EnvoyFilter");
    let patches = ef["spec"]["configPatches"].as_array().unwrap();
    let mut cfg = yaml_docs("examples/istio/testdata/gateway-bootstrap.yaml").remove(0);
    let counts = apply(&mut cfg, patches);
    for (p, n) in patches.iter().zip(&counts) {
        assert_eq!(*n, 1, "patch must match exactly once: {}", p["applyTo"]);
    }

    let listeners = cfg["static_resources"]["listeners"].as_array().unwrap();
    let main = &listeners[0];
    let hcm = &main["filter_chains"][0]["filters"][0]["typed_config"];
    let names: Vec<&str> = hcm["http_filters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "envoy.filters.http.grpc_stats",
            "envoy.filters.http.fault",
            "envoy.filters.http.cors",
            "kvroute",
            "envoy.filters.http.router"
        ]
    );
    let kv = &hcm["http_filters"][3]["typed_config"]["config"];
    assert_eq!(kv["allow_on_headers_stop_iteration"], true);
    assert_eq!(kv["failure_policy"], "FAIL_OPEN");
    assert_eq!(main["per_connection_buffer_limit_bytes"], 8388608);
    let ingest = listeners
        .iter()
        .find(|l| l["name"] == "kvroute-ingest")
        .unwrap();
    assert_eq!(
        ingest["address"]["socket_address"],
        json!({"address": "0.0.0.0", "port_value": 15901})
    );
    let cluster = &cfg["static_resources"]["clusters"][0];
    assert_eq!(
        cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
            ["override_host_sources"],
        json!([{"header": "x-gateway-destination-endpoint"}])
    );
    assert_eq!(
        hcm["route_config"]["internal_only_headers"],
        json!(["x-gateway-destination-endpoint", "x-kvroute-decision"])
    );
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0];
    assert_eq!(route["route"]["retry_policy"]["num_retries"], 2);
    // Istio's own settings on the route survive the merge.
    assert_eq!(route["route"]["timeout"], "300s");

    // envoy --mode validate with the built module in place of the mounted one.
    let wasm = wasm_path();
    assert!(wasm.is_file(), "build the filter first: {}", wasm.display());
    let text = serde_json::to_string_pretty(&cfg)
        .unwrap()
        .replace("/etc/kvroute/plugin.wasm", &wasm.display().to_string());
    let out = std::env::temp_dir().join(format!("kvroute-istio-{}.json", std::process::id()));
    std::fs::write(&out, text).unwrap();
    Envoy::validate(&out).unwrap_or_else(|e| panic!("{e}"));
    let _ = std::fs::remove_file(&out);
}

#[test]
fn istio_example_pieces_agree() {
    let ef_docs = yaml_docs("examples/istio/kvroute-envoyfilter.yaml");
    let ef = kind(&ef_docs, "EnvoyFilter");
    let patches = ef["spec"]["configPatches"].as_array().unwrap();
    let ingest = patches
        .iter()
        .find(|p| p["patch"]["value"]["name"] == "kvroute-ingest")
        .unwrap();
    let ingest_port = &ingest["patch"]["value"]["address"]["socket_address"]["port_value"];
    let ingest_cfg: Value = serde_json::from_str(
        ingest["patch"]["value"]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
            [0]["typed_config"]["config"]["configuration"]["value"]
            .as_str()
            .unwrap(),
    )
    .unwrap();

    // kvroute-cp's config (the kustomize base's ConfigMap file).
    let cp = yaml_docs("deploy/kustomize/kvroute-cp.yaml").remove(0);
    let gw = &cp["kubernetes"]["gateways"][0];
    assert_eq!(&gw["port"], ingest_port, "cp pushes to the ingest port");
    assert_eq!(gw["selector"], ef["spec"]["workloadSelector"]["labels"]);
    assert_eq!(gw["namespace"], ef["metadata"]["namespace"]);
    // The token: docs/deploy.md's commands put one value in both places, the EnvoyFilter's
    // placeholder (replaced by `sed`) and the Secret kvroute-cp's token file comes from
    // (created apart: the base holds no Secret, so `kubectl apply -k` cannot put a
    // placeholder back over it).
    let placeholder = ingest_cfg["ingest_token"].as_str().unwrap();
    let deploy_md = std::fs::read_to_string(workspace_root().join("docs/deploy.md")).unwrap();
    let sed = format!(r#"sed "s|{placeholder}|$TOKEN|" examples/istio/kvroute-envoyfilter.yaml"#);
    assert!(deploy_md.contains(&sed), "docs/deploy.md lacks {sed}");
    let base = yaml_docs("examples/kubernetes/kvroute-cp.yaml");
    assert!(
        base.iter().all(|d| d["kind"] != "Secret"),
        "the base holds no Secret"
    );
    let deployment = kind(&base, "Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["secret"].is_object())
        .unwrap();
    let secret_name = volume["secret"]["secretName"].as_str().unwrap();
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume["name"])
        .unwrap();
    assert_eq!(
        cp["push"]["token_file"],
        format!("{}/token", mount["mountPath"].as_str().unwrap()),
        "kvroute-cp reads the Secret's key `token`"
    );
    let create = format!(
        r#"kubectl -n {} create secret generic {secret_name} --from-literal=token="$TOKEN""#,
        deployment["metadata"]["namespace"].as_str().unwrap()
    );
    assert!(deploy_md.contains(&create), "docs/deploy.md lacks {create}");
    let cluster = patches.iter().find(|p| p["applyTo"] == "CLUSTER").unwrap();
    assert_eq!(
        cp["kubernetes"]["inference_pools"][0]["cluster"],
        format!(
            "outbound|{}||{}",
            cluster["match"]["cluster"]["portNumber"],
            cluster["match"]["cluster"]["service"].as_str().unwrap()
        )
    );

    // The routing objects the patches match.
    let routing = yaml_docs("examples/istio/routing.yaml");
    let vs = kind(&routing, "VirtualService");
    let route_patch = patches
        .iter()
        .find(|p| p["applyTo"] == "HTTP_ROUTE")
        .unwrap();
    assert_eq!(
        vs["spec"]["http"][0]["name"],
        route_patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
    );
    let dest = &vs["spec"]["http"][0]["route"][0]["destination"];
    assert_eq!(dest["host"], cluster["match"]["cluster"]["service"]);
    assert_eq!(
        dest["port"]["number"],
        cluster["match"]["cluster"]["portNumber"]
    );
    let pool = kind(&routing, "InferencePool");
    assert_eq!(
        pool["metadata"]["name"],
        cp["kubernetes"]["inference_pools"][0]["name"]
    );
    let svc = kind(&routing, "Service");
    assert_eq!(
        svc["spec"]["selector"],
        pool["spec"]["selector"]["matchLabels"]
    );

    // The gateway pods expose the port and only kvroute-cp may reach it.
    let patch = yaml_docs("examples/istio/gateway-patch.yaml").remove(0);
    assert_eq!(
        &patch["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"],
        ingest_port
    );
    let np = yaml_docs("examples/istio/networkpolicy.yaml").remove(0);
    assert_eq!(&np["spec"]["ingress"][0]["ports"][0]["port"], ingest_port);
    assert_eq!(np["spec"]["podSelector"]["matchLabels"], gw["selector"]);
}
