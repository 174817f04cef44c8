//! Config validation: a full config, a minimal config, and one invalid case per field,
//! each with its exact error.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_cp::adapters::ServerKind;
use kvroute_cp::{Config, ConfigError};
use std::time::Duration;

const FULL: &str = r#"
listen: 0.0.0.0:9090
scrape:
  interval_ms: 250
  timeout_ms: 400
  jitter: 0.2
  max_body_bytes: 1048576
push:
  heartbeat_ms: 2000
  min_interval_ms: 20
  timeout_ms: 300
  backoff_initial_ms: 50
  backoff_max_ms: 1000
  token_env: MY_TOKEN
targets:
  - name: envoy-a
    url: http://10.0.0.1:15000/kvroute/v1/snapshot
pools:
  - name: llama
    kind: vllm
    models: [meta-llama/Llama-3.1-8B-Instruct]
    endpoints:
      - name: pod-0
        address: 10.1.0.1:8000
      - name: pod-1
        address: "[fd00::2]:8000"
        metrics_url: http://[fd00::2]:9400/metrics
        cluster: llama_pod1
        kind: llamacpp
        models: [smol]
"#;

#[test]
fn full_config() {
    let c = Config::from_yaml(FULL).unwrap();
    assert_eq!(c.listen, "0.0.0.0:9090".parse().unwrap());
    assert_eq!(c.scrape.interval, Duration::from_millis(250));
    assert_eq!(c.scrape.timeout, Duration::from_millis(400));
    assert_eq!(c.scrape.jitter, 0.2);
    assert_eq!(c.scrape.max_body_bytes, 1_048_576);
    assert_eq!(c.push.heartbeat, Duration::from_secs(2));
    assert_eq!(c.push.min_interval, Duration::from_millis(20));
    assert_eq!(c.push.backoff_max, Duration::from_secs(1));
    assert_eq!(c.push.token_env, "MY_TOKEN");
    assert_eq!(
        c.targets[0].url.to_string(),
        "http://10.0.0.1:15000/kvroute/v1/snapshot"
    );
    let e0 = &c.endpoints[0];
    assert_eq!(e0.id, "llama/pod-0");
    assert_eq!(e0.metrics_url.to_string(), "http://10.1.0.1:8000/metrics");
    assert_eq!(e0.cluster, "llama");
    assert_eq!(e0.kind, ServerKind::Vllm);
    assert_eq!(e0.slots_url, None);
    assert_eq!(e0.models, vec!["meta-llama/Llama-3.1-8B-Instruct"]);
    let e1 = &c.endpoints[1];
    assert_eq!(e1.id, "llama/pod-1");
    assert_eq!(e1.address, "[fd00::2]:8000");
    assert_eq!(e1.cluster, "llama_pod1");
    assert_eq!(e1.kind, ServerKind::Llamacpp);
    assert_eq!(
        e1.slots_url.as_ref().unwrap().to_string(),
        "http://[fd00::2]:9400/slots"
    );
    assert_eq!(e1.models, vec!["smol"]);
    // The pool's own models (the endpoints' default), for the snapshot's
    // `unavailable_models` when the pool has no endpoint.
    assert_eq!(
        c.pool_models,
        [(
            "llama".to_string(),
            vec!["meta-llama/Llama-3.1-8B-Instruct".to_string()]
        )]
        .into_iter()
        .collect()
    );
}

#[test]
fn minimal_config_gets_documented_defaults() {
    let c = Config::from_yaml("pools: []\n").unwrap();
    assert_eq!(c.listen, "127.0.0.1:9090".parse().unwrap());
    assert_eq!(c.scrape.interval, Duration::from_millis(200));
    assert_eq!(c.scrape.timeout, Duration::from_millis(500));
    assert_eq!(c.scrape.jitter, 0.1);
    assert_eq!(c.scrape.max_body_bytes, 8 << 20);
    assert_eq!(c.push.heartbeat, Duration::from_secs(1));
    assert_eq!(c.push.min_interval, Duration::from_millis(10));
    assert_eq!(c.push.timeout, Duration::from_secs(1));
    assert_eq!(c.push.backoff_initial, Duration::from_millis(100));
    assert_eq!(c.push.backoff_max, Duration::from_secs(5));
    assert_eq!(c.push.token_env, "KVROUTE_INGEST_TOKEN");
    assert_eq!(c.push.peer_load.interval, Duration::from_millis(200));
    assert_eq!(c.push.peer_load.timeout, Duration::from_millis(500));
    assert_eq!(c.push.peer_load.stale_after, Duration::from_secs(2));
    assert!(c.targets.is_empty() && c.endpoints.is_empty());
}

fn err(yaml: &str) -> String {
    Config::from_yaml(yaml).unwrap_err().to_string()
}

fn with_endpoint(field: &str) -> String {
    format!("pools:\n  - name: p\n    endpoints:\n      - name: a\n        address: 127.0.0.1:1\n      - name: b\n        address: 127.0.0.1:2\n        {field}\n")
}

#[test]
fn invalid_fields_are_named() {
    let cases: &[(&str, &str)] = &[
        ("listen: nowhere\n", "config field `listen` = `nowhere`: not an ip:port socket address"),
        ("scrape:\n  interval_ms: 5\n", "config field `scrape.interval_ms` = `5`: must be in 10..=60000 ms"),
        ("scrape:\n  timeout_ms: 0\n", "config field `scrape.timeout_ms` = `0`: must be in 1..=60000 ms"),
        ("scrape:\n  jitter: 1.5\n", "config field `scrape.jitter` = `1.5`: must be a ratio in 0..=1"),
        ("scrape:\n  max_body_bytes: 10\n", "config field `scrape.max_body_bytes` = `10`: must be at least 1024"),
        ("push:\n  heartbeat_ms: 10\n", "config field `push.heartbeat_ms` = `10`: must be in 50..=60000 ms"),
        ("push:\n  min_interval_ms: 5000\n", "config field `push.min_interval_ms` = `5000`: must be in 0..=1000 ms"),
        ("push:\n  backoff_max_ms: 10\n", "config field `push.backoff_max_ms` = `10`: must be in 100..=600000 ms"),
        ("push:\n  token_env: ''\n", "config field `push.token_env` = ``: must not be empty"),
        ("scrape:\n  token_env: ''\n", "config field `scrape.token_env` = ``: must not be empty"),
        ("targets:\n  - name: e\n    url: ftp://x:1/\n", "config field `targets[0].url` = `ftp://x:1/`: must start with http:// or https://"),
        // A port out of 1..=65535 would make hyper silently use the scheme's default port.
        ("targets:\n  - name: e\n    url: http://127.0.0.1:99999/kvroute/v1/snapshot\n", "config field `targets[0].url` = `http://127.0.0.1:99999/kvroute/v1/snapshot`: has an invalid port (expected 1..=65535)"),
        ("targets:\n  - name: e\n    url: https://[::1]:0/kvroute/v1/snapshot\n", "config field `targets[0].url` = `https://[::1]:0/kvroute/v1/snapshot`: has an invalid port (expected 1..=65535)"),
        ("targets:\n  - name: e\n    url: http://a:1/\n    stats_url: http://a:65536/stats\n", "config field `targets[0].stats_url` = `http://a:65536/stats`: has an invalid port (expected 1..=65535)"),
        ("kubernetes:\n  api_server: https://k8s:70000\n", "config field `kubernetes.api_server` = `https://k8s:70000`: has an invalid port (expected 1..=65535)"),
        ("scrape:\n  tls:\n    cert_file: /c.pem\n", "config field `scrape.tls.cert_file` = `/c.pem`: needs key_file too"),
        ("push:\n  tls:\n    key_file: /k.pem\n", "config field `push.tls.key_file` = `/k.pem`: needs cert_file too"),
        ("kubernetes:\n  api_server: ftp://x\n", "config field `kubernetes.api_server` = `ftp://x`: must be an http:// or https:// URL with a host"),
        ("kubernetes:\n  inference_pools:\n    - {namespace: Default, name: p}\n", "config field `kubernetes.inference_pools[0].namespace` = `Default`: must be a Kubernetes name (lower-case letters, digits, `-`, `.`)"),
        ("pools:\n  - name: p\n    endpoints: []\nkubernetes:\n  inference_pools:\n    - {namespace: default, name: p}\n", "config field `kubernetes.inference_pools[0].name` = `p`: duplicate pool name (pool names are unique across `pools` and `kubernetes.inference_pools`)"),
        ("kubernetes:\n  inference_pools:\n    - {namespace: default, name: p, scheme: ftp}\n", "config field `kubernetes.inference_pools[0].scheme` = `ftp`: must be `http` or `https`"),
        ("kubernetes:\n  inference_pools:\n    - {namespace: default, name: p, metrics_path: metrics}\n", "config field `kubernetes.inference_pools[0].metrics_path` = `metrics`: must be a URL path starting with `/`"),
        ("kubernetes:\n  inference_pools:\n    - {namespace: default, name: p, metrics_port: 0}\n", "config field `kubernetes.inference_pools[0].metrics_port` = `0`: must be in 1..=65535"),
        ("kubernetes:\n  gateways:\n    - {name: g, namespace: istio-system, selector: {}, port: 15901}\n", "config field `kubernetes.gateways[0].selector` = `{}`: needs at least one label (an empty selector would push to every pod)"),
        ("kubernetes:\n  gateways:\n    - {name: g, namespace: istio-system, selector: {a: b}, port: 0}\n", "config field `kubernetes.gateways[0].port` = `0`: must be in 1..=65535"),
        ("kubernetes:\n  gateways:\n    - {name: g, namespace: n, selector: {a: b}, port: 1}\n    - {name: g, namespace: n, selector: {a: b}, port: 1}\n", "config field `kubernetes.gateways[1].name` = `g`: must be non-empty, unique, without control characters"),
        ("targets:\n  - name: e\n    url: http://a:1/\n  - name: e\n    url: http://b:1/\n", "config field `targets[1].name` = `e`: duplicate target name"),
        ("pools:\n  - name: a/b\n    endpoints: []\n", "config field `pools[0].name` = `a/b`: must be non-empty and contain no `/`"),
        ("push:\n  peer_load: {interval_ms: 5}\n", "config field `push.peer_load.interval_ms` = `5`: must be in 10..=60000 ms"),
        ("push:\n  peer_load: {timeout_ms: 0}\n", "config field `push.peer_load.timeout_ms` = `0`: must be in 1..=60000 ms"),
        ("push:\n  peer_load: {interval_ms: 500, stale_after_ms: 100}\n", "config field `push.peer_load.stale_after_ms` = `100`: must be in 500..=600000 ms"),
        ("targets:\n  - name: e\n    url: http://a:1/\n    stats_url: ftp://a:9901/stats\n", "config field `targets[0].stats_url` = `ftp://a:9901/stats`: must start with http:// or https://"),
        ("kubernetes:\n  gateways:\n    - {name: g, namespace: n, selector: {a: b}, port: 1, stats_port: 0}\n", "config field `kubernetes.gateways[0].stats_port` = `0`: must be in 1..=65535"),
        ("kubernetes:\n  gateways:\n    - {name: g, namespace: n, selector: {a: b}, port: 1, stats_path: stats}\n", "config field `kubernetes.gateways[0].stats_path` = `stats`: must be a URL path starting with `/`"),
        ("pools:\n  - name: p\n    endpoints: []\n  - name: p\n    endpoints: []\n", "config field `pools[1].name` = `p`: duplicate pool name"),
        ("pools:\n  - name: p\n    models: [ok, '']\n    endpoints: []\n", "config field `pools[0].models` = ``: model names must be non-empty without control characters"),
        // A bad pool-level name inherited by an endpoint is the pool's field, not the endpoint's.
        ("pools: [{name: p, models: [''], endpoints: [{name: e, address: 'host:8001'}]}]\n", "config field `pools[0].models` = ``: model names must be non-empty without control characters"),
        ("pools: [{name: p, models: [ok, \"m\\n\"], endpoints: [{name: e, address: 'host:8001'}]}]\n", "config field `pools[0].models` = `m\\n`: model names must be non-empty without control characters"),
    ];
    for (yaml, want) in cases {
        assert_eq!(&err(yaml), want, "for {yaml:?}");
    }
    let ep_cases: &[(&str, &str)] = &[
        ("metrics_url: ftp://x/metrics", "config field `pools[0].endpoints[1].metrics_url` = `ftp://x/metrics`: must start with http:// or https://"),
        ("metrics_url: 'not a url'", "config field `pools[0].endpoints[1].metrics_url` = `not a url`: not a URL (invalid uri character)"),
        ("slots_url: /slots", "config field `pools[0].endpoints[1].slots_url` = `/slots`: must start with http:// or https://"),
        ("metrics_url: http://127.0.0.1:99999/metrics", "config field `pools[0].endpoints[1].metrics_url` = `http://127.0.0.1:99999/metrics`: has an invalid port (expected 1..=65535)"),
        ("slots_url: 'http://127.0.0.1:/slots'", "config field `pools[0].endpoints[1].slots_url` = `http://127.0.0.1:/slots`: has an invalid port (expected 1..=65535)"),
        ("metrics_url: 'http://user@h:0/metrics'", "config field `pools[0].endpoints[1].metrics_url` = `http://user@h:0/metrics`: has an invalid port (expected 1..=65535)"),
        ("cluster: ''", "config field `pools[0].endpoints[1].cluster` = ``: must not be empty"),
        ("models: ['']", "config field `pools[0].endpoints[1].models` = ``: model names must not be empty"),
    ];
    for (field, want) in ep_cases {
        assert_eq!(&err(&with_endpoint(field)), want, "for {field}");
    }
    assert_eq!(
        err("pools:\n  - name: p\n    endpoints:\n      - name: a\n        address: nohost\n"),
        "config field `pools[0].endpoints[0].address` = `nohost`: has no port"
    );
    assert_eq!(
        err("pools:\n  - name: p\n    endpoints:\n      - name: a\n        address: 127.0.0.1:1\n      - name: a\n        address: 127.0.0.1:2\n"),
        "config field `pools[0].endpoints[1].name` = `a`: duplicate endpoint name in this pool"
    );
}

/// Values kvroute-core's `Snapshot::validate` rejects must fail at config time: one of them
/// in a snapshot makes every Envoy drop the whole push, for all endpoints.
#[test]
fn values_the_filter_rejects_fail_validation() {
    let ep_cases: &[(&str, &str)] = &[
        ("cluster: \"c\\r\\nx-evil: 1\"", "config field `pools[0].endpoints[1].cluster` = `c\\r\\nx-evil: 1`: must not contain control characters (CR, LF, NUL...)"),
        ("models: [\"m\\n\"]", "config field `pools[0].endpoints[1].models` = `m\\n`: must not contain control characters (CR, LF, NUL...)"),
    ];
    for (field, want) in ep_cases {
        assert_eq!(&err(&with_endpoint(field)), want, "for {field}");
    }
    assert_eq!(
        err("pools:\n  - name: p\n    endpoints:\n      - name: a\n        address: 127.0.0.1:0\n"),
        "config field `pools[0].endpoints[0].address` = `127.0.0.1:0`: has an invalid port (expected 1..=65535)"
    );
    assert_eq!(
        err("pools:\n  - name: p\n    endpoints:\n      - name: \"a\\tb\"\n        address: 127.0.0.1:1\n"),
        "config field `pools[0].endpoints[0].name` = `a\\tb`: must not contain control characters (CR, LF, NUL...)"
    );
    assert_eq!(
        err("pools:\n  - name: \"p\\u0000\"\n    endpoints: []\n"),
        "config field `pools[0].name` = `p\\0`: must not contain control characters (CR, LF, NUL...)"
    );
    // Names over kvroute-core's MAX_LABEL_BYTES (1024): the filter would reject every snapshot.
    let long = "x".repeat(1025);
    let half = "y".repeat(600);
    let cases = [
        (
            format!("pools:\n  - name: {long}\n    endpoints: []\n"),
            format!("config field `pools[0].name` = `{long}`: must be at most 1024 bytes"),
        ),
        (
            format!("pools:\n  - name: p\n    models: [ok, {long}]\n    endpoints: []\n"),
            format!("config field `pools[0].models` = `{long}`: must be at most 1024 bytes"),
        ),
        (
            with_endpoint(&format!("models: [{long}]")),
            format!("config field `pools[0].endpoints[1].models` = `{long}`: must be at most 1024 bytes"),
        ),
        (
            with_endpoint(&format!("cluster: {long}")),
            format!("config field `pools[0].endpoints[1].cluster` = `{long}`: must be at most 1024 bytes"),
        ),
        // Each part fits; the id `pool/name` (1,201 bytes) does not.
        (
            format!("pools:\n  - name: {half}\n    endpoints:\n      - name: {half}\n        address: 127.0.0.1:1\n"),
            format!("config field `pools[0].endpoints[0].name` = `{half}`: with the pool's name and a `/` (the endpoint's id) must be at most 1024 bytes"),
        ),
        (
            format!("kubernetes:\n  inference_pools:\n    - {{namespace: default, name: p, cluster: {long}}}\n"),
            format!("config field `kubernetes.inference_pools[0].cluster` = `{long}`: must be at most 1024 bytes"),
        ),
        (
            format!("kubernetes:\n  gateways:\n    - {{name: {long}, namespace: n, selector: {{a: b}}, port: 1}}\n"),
            format!("config field `kubernetes.gateways[0].name` = `{long}`: must be at most 1024 bytes"),
        ),
    ];
    for (yaml, want) in cases {
        assert_eq!(err(&yaml), want, "for {yaml:?}");
    }
    // A value past 4 KiB is cut in the error, its length given.
    let huge = "é".repeat(5_000);
    let e = err(&format!("pools:\n  - name: {huge}\n    endpoints: []\n"));
    assert_eq!(
        e,
        format!(
            "config field `pools[0].name` = `{}… (10000 bytes in all)`: must be at most 1024 bytes",
            "é".repeat(2_048)
        )
    );
    // At the bound: accepted.
    let at = "z".repeat(1024);
    assert!(Config::from_yaml(&with_endpoint(&format!("cluster: {at}"))).is_ok());
}

#[test]
fn unknown_fields_and_kinds_are_rejected_by_name() {
    let e = err("scrape:\n  intervall_ms: 100\n");
    assert!(
        e.starts_with("config: scrape: unknown field `intervall_ms`"),
        "{e}"
    );
    let e = err(&with_endpoint("kind: vllm2"));
    assert!(
        e.starts_with("config: pools[0].endpoints[1].kind: unknown variant `vllm2`"),
        "{e}"
    );
}

#[test]
fn empty_config_is_rejected() {
    assert_eq!(err(""), "config: the config is empty");
    assert_eq!(err("  \n"), "config: the config is empty");
}

#[test]
fn missing_file_is_a_read_error() {
    let e = Config::load(std::path::Path::new("/nonexistent/kvroute.yaml")).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }));
    assert!(e
        .to_string()
        .starts_with("cannot read config file /nonexistent/kvroute.yaml: "));
}

#[test]
fn token_sources() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("t");
    std::fs::write(&f, "  abc \n").unwrap();
    let c = Config::from_yaml(&format!("push:\n  token_file: {}\n", f.display())).unwrap();
    assert_eq!(c.push.read_token().unwrap().as_deref(), Some("abc"));
    std::fs::write(&f, "\n").unwrap();
    assert_eq!(
        c.push.read_token().unwrap_err().to_string(),
        format!(
            "config field `push.token_file` = `{}`: file is empty",
            f.display()
        )
    );
    // A line break inside would make every push fail to build its request.
    std::fs::write(&f, "abc\ndef\n").unwrap();
    assert_eq!(
        c.push.read_token().unwrap_err().to_string(),
        format!(
            "config field `push.token_file` = `{}`: token is not a valid HTTP header value (control character or line break inside)",
            f.display()
        )
    );
    // A missing token file is named as the token file, not as "config file".
    let missing = dir.path().join("missing");
    let c = Config::from_yaml(&format!("push:\n  token_file: {}\n", missing.display())).unwrap();
    assert_eq!(
        c.push.read_token().unwrap_err().to_string(),
        format!(
            "config field `push.token_file` = `{}`: cannot read: No such file or directory (os error 2)",
            missing.display()
        )
    );
    let c = Config::from_yaml("push:\n  token_env: KVROUTE_TEST_TOKEN_UNSET_XYZ\n").unwrap();
    assert_eq!(c.push.read_token().unwrap(), None);
}

/// The scrape token is read as the ingest token is, with errors naming `scrape.*`; with
/// neither field set there is none (no default variable).
#[test]
fn scrape_token_sources() {
    let c = Config::from_yaml("pools: []\n").unwrap();
    let t = c.scrape.token();
    assert_eq!(
        (
            c.scrape.token_file.as_deref(),
            c.scrape.token_env.as_deref()
        ),
        (None, None)
    );
    assert!(!t.is_set());
    assert_eq!(t.source(), None);
    assert_eq!(t.read().unwrap(), None);

    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("api-key");
    std::fs::write(&f, "  llama-key \n").unwrap();
    let c = Config::from_yaml(&format!(
        "scrape:\n  token_file: {}\n  token_env: KVROUTE_TEST_SCRAPE_TOKEN_UNSET_XYZ\n",
        f.display()
    ))
    .unwrap();
    let t = c.scrape.token();
    assert_eq!(t.read().unwrap().as_deref(), Some("llama-key"));
    assert_eq!(t.source(), Some(format!("file `{}`", f.display())));
    std::fs::write(&f, "\n").unwrap();
    assert_eq!(
        t.read().unwrap_err().to_string(),
        format!(
            "config field `scrape.token_file` = `{}`: file is empty",
            f.display()
        )
    );
    std::fs::write(&f, "abc\ndef\n").unwrap();
    assert_eq!(
        t.read().unwrap_err().to_string(),
        format!(
            "config field `scrape.token_file` = `{}`: token is not a valid HTTP header value (control character or line break inside)",
            f.display()
        )
    );
    let missing = dir.path().join("missing");
    let c = Config::from_yaml(&format!("scrape:\n  token_file: {}\n", missing.display())).unwrap();
    assert_eq!(
        c.scrape.token().read().unwrap_err().to_string(),
        format!(
            "config field `scrape.token_file` = `{}`: cannot read: No such file or directory (os error 2)",
            missing.display()
        )
    );
    // A variable that is unset reads as no token; the source is still named.
    let c =
        Config::from_yaml("scrape:\n  token_env: KVROUTE_TEST_SCRAPE_TOKEN_UNSET_XYZ\n").unwrap();
    let t = c.scrape.token();
    assert_eq!(t.read().unwrap(), None);
    assert_eq!(
        t.source().as_deref(),
        Some("environment variable `KVROUTE_TEST_SCRAPE_TOKEN_UNSET_XYZ`")
    );
    // Only this test reads this variable.
    std::env::set_var("KVROUTE_TEST_SCRAPE_TOKEN_BAD", "abc\ndef");
    let c = Config::from_yaml("scrape:\n  token_env: KVROUTE_TEST_SCRAPE_TOKEN_BAD\n").unwrap();
    assert_eq!(
        c.scrape.token().read().unwrap_err().to_string(),
        "config field `scrape.token_env` = `KVROUTE_TEST_SCRAPE_TOKEN_BAD`: token is not a valid HTTP header value (control character or line break inside)"
    );
}

/// A pool's own scrape token (`pools[i]` or `kubernetes.inference_pools[i]`,
/// `scrape_token_file` / `scrape_token_env`) is read as `scrape.token_*` is, with errors
/// naming the pool's field; its endpoints get it, the other pools' the `scrape.token_*` one.
#[test]
fn pool_scrape_token_sources() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("api-key");
    std::fs::write(&f, "pool-key\n").unwrap();
    let yaml = format!(
        "scrape:\n  token_env: KVROUTE_TEST_POOL_SCRAPE_SHARED_UNSET\n\
         pools:\n\
         \x20 - name: a\n    endpoints: []\n\
         \x20 - name: b\n    scrape_token_file: {}\n    endpoints: []\n\
         kubernetes:\n  inference_pools:\n\
         \x20   - {{namespace: ns, name: c, scrape_token_env: KVROUTE_TEST_POOL_SCRAPE_C_UNSET}}\n\
         \x20   - {{namespace: ns, name: d}}\n",
        f.display()
    );
    let c = Config::from_yaml(&yaml).unwrap();
    let sources: Vec<(String, Option<String>)> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|p| (p.to_owned(), c.scrape.token_for(p).source()))
        .collect();
    let shared = Some("environment variable `KVROUTE_TEST_POOL_SCRAPE_SHARED_UNSET`".to_owned());
    assert_eq!(
        sources,
        vec![
            ("a".to_owned(), shared.clone()),
            ("b".to_owned(), Some(format!("file `{}`", f.display()))),
            (
                "c".to_owned(),
                Some("environment variable `KVROUTE_TEST_POOL_SCRAPE_C_UNSET`".to_owned())
            ),
            ("d".to_owned(), shared),
        ]
    );
    assert_eq!(
        c.scrape.token_for("b").read().unwrap().as_deref(),
        Some("pool-key")
    );
    assert_eq!(c.scrape.token_for("c").read().unwrap(), None);
    std::fs::write(&f, "\n").unwrap();
    assert_eq!(
        c.scrape.token_for("b").read().unwrap_err().to_string(),
        format!(
            "config field `pools[1].scrape_token_file` = `{}`: file is empty",
            f.display()
        )
    );
    assert_eq!(
        Config::from_yaml("kubernetes:\n  inference_pools:\n    - {namespace: ns, name: c, scrape_token_env: ''}\n")
            .unwrap_err()
            .to_string(),
        "config field `kubernetes.inference_pools[0].scrape_token_env` = ``: must not be empty"
    );
}

/// An ingest or scrape token from a variable is trimmed as one from a file is (and as the
/// filter trims what it receives): `KVROUTE_INGEST_TOKEN=' tok '` or a trailing newline
/// (`$(cat token)` keeps none, but `export T="$(cat f)\n"` or a Secret's env does) must
/// not read as a different token, nor be refused as a line break.
#[test]
fn env_tokens_are_trimmed_like_file_tokens() {
    // Only this test reads these variables.
    std::env::set_var("KVROUTE_TEST_PUSH_TOKEN_SPACES", " tok-0123456789abcdef ");
    std::env::set_var("KVROUTE_TEST_PUSH_TOKEN_NEWLINE", "tok-0123456789abcdef\n");
    std::env::set_var("KVROUTE_TEST_PUSH_TOKEN_BLANK", " \n");
    for var in [
        "KVROUTE_TEST_PUSH_TOKEN_SPACES",
        "KVROUTE_TEST_PUSH_TOKEN_NEWLINE",
    ] {
        let c = Config::from_yaml(&format!("push:\n  token_env: {var}\n")).unwrap();
        assert_eq!(
            c.push.read_token().unwrap().as_deref(),
            Some("tok-0123456789abcdef"),
            "{var}"
        );
        let c = Config::from_yaml(&format!("scrape:\n  token_env: {var}\n")).unwrap();
        assert_eq!(
            c.scrape.token().read().unwrap().as_deref(),
            Some("tok-0123456789abcdef"),
            "{var}"
        );
    }
    let c = Config::from_yaml("push:\n  token_env: KVROUTE_TEST_PUSH_TOKEN_BLANK\n").unwrap();
    assert_eq!(c.push.read_token().unwrap(), None);
}

#[test]
fn shipped_examples_are_valid() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = root.join("examples/control-plane/kvroute-cp.yaml");
    let c = Config::load(&path).unwrap();
    assert_eq!((c.endpoints.len(), c.targets.len()), (2, 1));
    // Its commented-out forms (a second Envoy, a llama.cpp pool) are valid once uncommented:
    // every `  # - ` / `  #   ` line is commented YAML, the other comments are prose.
    let text = std::fs::read_to_string(&path).unwrap();
    let uncommented: String = text
        .lines()
        .map(|l| match l.strip_prefix("  # ") {
            Some(rest) if rest.starts_with("- ") || rest.starts_with("  ") => format!("  {rest}\n"),
            _ => format!("{l}\n"),
        })
        .collect();
    let u = Config::from_yaml(&uncommented).unwrap();
    assert_eq!((u.endpoints.len(), u.targets.len()), (3, 2));
    assert_eq!(u.endpoints[2].kind, ServerKind::Llamacpp);
    assert!(u.targets[1].stats_url.is_some());
    // The example pairs with examples/envoy/cluster-mode.yaml: same backends, same cluster
    // names, and its target is that Envoy's ingest listener (tests/binary.rs runs
    // `--check --envoy-config` on it with every example Envoy config).
    let envoy = std::fs::read_to_string(root.join("examples/envoy/cluster-mode.yaml")).unwrap();
    for (i, (addr, cluster)) in [("127.0.0.1:8001", "vllm-a"), ("127.0.0.1:8002", "vllm-b")]
        .into_iter()
        .enumerate()
    {
        assert_eq!(c.endpoints[i].address, addr);
        assert_eq!(c.endpoints[i].cluster, cluster);
        assert!(envoy.contains(&format!("- name: {cluster}\n")), "{cluster}");
    }
    assert_eq!(
        c.targets[0].url.to_string(),
        "http://127.0.0.1:10001/kvroute/v1/snapshot"
    );
    assert!(envoy.contains("address: 127.0.0.1, port_value: 10001"));
    // The ConfigMap embedded in the Kubernetes example.
    let text = std::fs::read_to_string(root.join("examples/kubernetes/kvroute-cp.yaml")).unwrap();
    let mut found = 0;
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v: serde_yaml_ng::Value = serde::Deserialize::deserialize(doc).unwrap();
        if let Some(cfg) = v
            .get("data")
            .and_then(|d| d.get("kvroute-cp.yaml"))
            .and_then(|s| s.as_str())
        {
            // Kubernetes discovery: no static endpoints or targets, one pool, one gateway set.
            let c = Config::from_yaml(cfg).unwrap();
            assert_eq!((c.endpoints.len(), c.targets.len()), (0, 0));
            assert_eq!(
                (c.kubernetes.pools.len(), c.kubernetes.gateways.len()),
                (1, 1)
            );
            assert_eq!(
                c.push.token_file.as_deref(),
                Some(std::path::Path::new("/var/run/kvroute/token/token"))
            );
            found += 1;
        }
    }
    assert_eq!(found, 1);
}

#[test]
fn kubernetes_and_tls_sections() {
    let c = Config::from_yaml(
        "scrape:\n  tls: {ca_file: /ca.pem, cert_file: /c.pem, key_file: /k.pem}\n\
         push:\n  tls: {ca_file: /ca2.pem}\n\
         targets:\n  - {name: t, url: 'https://gw:15901/kvroute/v1/snapshot'}\n\
         kubernetes:\n  api_server: https://10.0.0.1:6443\n  inference_pools:\n\
         \x20   - {namespace: default, name: llama, kind: vllm, cluster: c, models: [m], metrics_port: 9400, metrics_path: /m, scheme: https}\n\
         \x20   - {namespace: models, name: qwen}\n\
         \x20 gateways:\n    - {name: gw, namespace: istio-system, selector: {istio: ingressgateway}, port: 15901}\n",
    )
    .unwrap();
    assert_eq!(
        c.scrape.tls.ca_file.as_deref(),
        Some(std::path::Path::new("/ca.pem"))
    );
    assert_eq!(
        c.scrape.tls.key_file.as_deref(),
        Some(std::path::Path::new("/k.pem"))
    );
    assert_eq!(
        c.push.tls.ca_file.as_deref(),
        Some(std::path::Path::new("/ca2.pem"))
    );
    assert_eq!(c.push.tls.cert_file, None);
    assert_eq!(c.targets[0].url.scheme_str(), Some("https"));
    let k = &c.kubernetes;
    assert_eq!(
        k.api_server.as_ref().unwrap().to_string(),
        "https://10.0.0.1:6443/"
    );
    let full = &k.pools[0];
    assert_eq!(
        (
            full.namespace.as_str(),
            full.name.as_str(),
            full.kind,
            full.cluster.as_str()
        ),
        ("default", "llama", ServerKind::Vllm, "c")
    );
    assert_eq!(full.models, vec!["m".to_string()]);
    assert_eq!(
        (
            full.metrics_port,
            full.metrics_path.as_str(),
            full.scheme.as_str()
        ),
        (Some(9400), "/m", "https")
    );
    // Defaults.
    let min = &k.pools[1];
    assert_eq!(
        (
            min.kind,
            min.cluster.as_str(),
            min.models.len(),
            min.metrics_port,
            min.metrics_path.as_str(),
            min.scheme.as_str()
        ),
        (ServerKind::Auto, "qwen", 0, None, "/metrics", "http")
    );
    let g = &k.gateways[0];
    assert_eq!(
        (
            g.name.as_str(),
            g.namespace.as_str(),
            g.port,
            g.path.as_str(),
            g.scheme.as_str()
        ),
        ("gw", "istio-system", 15901, "/kvroute/v1/snapshot", "http")
    );
    assert_eq!(
        g.selector.get("istio").map(String::as_str),
        Some("ingressgateway")
    );
    // Both InferencePools' models, `qwen`'s empty (read from its pods).
    assert_eq!(
        c.pool_models,
        [
            ("llama".to_string(), vec!["m".to_string()]),
            ("qwen".to_string(), vec![])
        ]
        .into_iter()
        .collect()
    );
    assert!(Config::from_yaml("listen: 127.0.0.1:1\n")
        .unwrap()
        .kubernetes
        .is_empty());
}

/// YAML aliases are followed, but a file that expands past 64 MiB through them is refused
/// before anything is built (a 1.1 MB file aliasing a 1 MiB string 20,000 times took
/// 21.8 GB); aliases of ordinary size still work.
#[test]
fn alias_bombs_are_refused_and_ordinary_aliases_work() {
    let big = "x".repeat(100 * 1024);
    let aliases = vec!["*s"; 1_000].join(", ");
    let bomb =
        format!("pools:\n  - name: p\n    models: [&s {big}, {aliases}]\n    endpoints: []\n");
    // Refused at the alias that crosses the bound (655 × ~100 KiB), named with its place.
    assert_eq!(
        err(&bomb),
        format!(
            "config: pools[0].models[655]: the config expands to more than {} bytes (YAML aliases repeating large nodes?) at line 3 column 14",
            kvroute_cp::config::MAX_EXPANDED_BYTES
        )
    );
    let ok = "pools:\n  - name: a\n    models: &m [m1, m2]\n    endpoints: []\n  - name: b\n    models: *m\n    endpoints: []\n";
    let c = Config::from_yaml(ok).unwrap();
    assert_eq!(
        c.pool_models.get("b").unwrap(),
        &vec!["m1".to_owned(), "m2".to_owned()]
    );
}
