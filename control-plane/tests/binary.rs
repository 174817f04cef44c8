//! The `kvroute-cp` binary: bad config exits 2 naming the field; SIGHUP and file changes
//! reload; SIGTERM shuts down cleanly.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvroute-cp");

/// `kvroute-cp --config <cfg> --check [--envoy-config <envoy>]` with `KVROUTE_INGEST_TOKEN`
/// and every variable of `env` removed, then each set where `env` gives it a value: the
/// exit code, stdout and stderr.
fn run_check(
    cfg: &std::path::Path,
    envoy: Option<&std::path::Path>,
    env: &[(&str, Option<&str>)],
) -> (Option<i32>, String, String) {
    let mut c = Command::new(BIN);
    c.arg("--config")
        .arg(cfg)
        .arg("--check")
        .env_remove("KVROUTE_INGEST_TOKEN");
    if let Some(e) = envoy {
        c.arg("--envoy-config").arg(e);
    }
    for (k, v) in env {
        c.env_remove(k);
        if let Some(v) = v {
            c.env(k, v);
        }
    }
    let out = c.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

struct Guard(Child);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

#[test]
fn bad_config_field_exits_2_with_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cp.yaml");
    std::fs::write(&cfg, "pools:\n  - name: p\n    endpoints:\n      - name: a\n        address: 127.0.0.1:1\n        metrics_url: ftp://x/metrics\n").unwrap();
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "kvroute-cp: config field `pools[0].endpoints[0].metrics_url` = `ftp://x/metrics`: must start with http:// or https://\n"
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "");
    // With --check the same error, and the closing line every check ends with.
    assert_eq!(
        run_check(&cfg, None, &[]),
        (
            Some(2),
            "config NOT ok: 1 error(s)\n".to_owned(),
            "kvroute-cp: config field `pools[0].endpoints[0].metrics_url` = `ftp://x/metrics`: must start with http:// or https://\n".to_owned()
        )
    );
    std::fs::write(&cfg, "pools: []\n").unwrap();
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&cfg)
        .arg("--check")
        .env_remove("KVROUTE_INGEST_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "note: ingest token: none found in environment variable `KVROUTE_INGEST_TOKEN`; no targets, so none is needed\n\
         config ok: 0 endpoints, 0 targets, listen 127.0.0.1:9090\n"
    );
}

/// Issue 14, case 6: `--check` says whether it found a token and where, which clusters
/// default to the pool name, and cross-checks an Envoy config (clusters, token, ports).
#[test]
fn check_reports_token_clusters_and_envoy_mismatches() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cp.yaml");
    let envoy = dir.path().join("envoy.yaml");
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/envoy/cluster-mode.yaml"
    ))
    .unwrap();
    std::fs::write(&envoy, &example).unwrap();
    let check = |yaml: &str, token: Option<&str>| {
        std::fs::write(&cfg, yaml).unwrap();
        let (code, stdout, _) = run_check(&cfg, Some(&envoy), &[("KVROUTE_INGEST_TOKEN", token)]);
        (code, stdout)
    };
    let base = "targets:\n  - name: envoy-0\n    url: http://127.0.0.1:10001/kvroute/v1/snapshot\n\
                pools:\n  - name: llama\n    endpoints:\n      - name: a\n        address: 127.0.0.1:8001\n        cluster: vllm-a\n";
    // Matching token, every cluster defined: ok.
    let good = "change-me-to-a-long-random-secret";
    assert_eq!(
        check(base, Some(good)),
        (
            Some(0),
            format!(
                "note: ingest token: found in environment variable `KVROUTE_INGEST_TOKEN` ({} bytes)\n\
                 config ok: 1 endpoints, 1 targets, listen 127.0.0.1:9090; matches the Envoy config (kvroute plugin configs, clusters, ingest token, ingest port, ingest path)\n",
                good.len()
            )
        )
    );
    // Cluster left out: defaults to the pool name, which this Envoy config lacks; and a
    // wrong token.
    let defaulted = base.replace("        cluster: vllm-a\n", "");
    assert_eq!(
        check(&defaulted, Some("not-the-envoy-token")),
        (
            Some(2),
            "note: ingest token: found in environment variable `KVROUTE_INGEST_TOKEN` (19 bytes)\n\
             note: pool `llama`: `cluster` not set for 1 endpoint(s) (a); it defaults to the pool name, so in cluster mode the filter routes them to Envoy cluster `llama`\n\
             error: cluster `llama` (endpoints llama/a) is not defined in the Envoy config (clusters: default, vllm-a, vllm-b); cluster mode would route them to a cluster Envoy does not have\n\
             error: the ingest token from environment variable `KVROUTE_INGEST_TOKEN` differs from the Envoy config's `ingest_token` on listener `ingest` (port 10001): every push would be answered 401\n\
             config NOT ok: 2 error(s)\n"
                .to_string()
        )
    );
    // Two gateways, one without a stats URL: its load is not shared.
    let two = base.replace(
        "targets:\n",
        "targets:\n  - name: envoy-1\n    url: http://127.0.0.1:10001/kvroute/v1/snapshot\n    stats_url: http://127.0.0.1:9901/stats/prometheus\n",
    );
    assert_eq!(
        check(&two, Some(good)),
        (
            Some(0),
            format!(
                "note: ingest token: found in environment variable `KVROUTE_INGEST_TOKEN` ({} bytes)\n\
                 note: load sharing: 1 of 2 targets have no `stats_url` (envoy-0); their in-flight load is not shared with the other gateways, which may then herd onto one endpoint between scrapes\n\
                 config ok: 1 endpoints, 2 targets, listen 127.0.0.1:9090; matches the Envoy config (kvroute plugin configs, clusters, ingest token, ingest port, ingest path)\n",
                good.len()
            )
        )
    );
    // No token at all while Envoy requires one; a target on another port.
    let other_port = base.replace(":10001/", ":10101/");
    assert_eq!(
        check(&other_port, None),
        (
            Some(2),
            "note: ingest token: none found in environment variable `KVROUTE_INGEST_TOKEN`: pushes carry no Authorization, and an ingest filter with an `ingest_token` answers them 401\n\
             error: the Envoy config's ingest filter on listener `ingest` (port 10001) requires an `ingest_token`, but none was found in environment variable `KVROUTE_INGEST_TOKEN`: every push would be answered 401\n\
             note: target `envoy-0` posts to port 10101, not an ingest listener port of this Envoy config (10001); fine if it is another Envoy\n\
             config NOT ok: 1 error(s)\n"
                .to_string()
        )
    );
    // A target on the client listener's port with the right token: ok, but the closing
    // line claims only what matched (not the ingest port, nor the path of a listener it
    // does not post to).
    let client_port = base.replace(":10001/", ":10000/");
    assert_eq!(
        check(&client_port, Some(good)),
        (
            Some(0),
            format!(
                "note: ingest token: found in environment variable `KVROUTE_INGEST_TOKEN` ({} bytes)\n\
                 note: target `envoy-0` posts to port 10000, not an ingest listener port of this Envoy config (10001); fine if it is another Envoy\n\
                 config ok: 1 endpoints, 1 targets, listen 127.0.0.1:9090; matches the Envoy config (kvroute plugin configs, clusters, ingest token)\n",
                good.len()
            )
        )
    );
}

/// `--check` names where the scrape token comes from (never the token) when one is
/// configured, and says nothing of it otherwise; an unusable token file exits 2 naming it.
#[test]
fn check_reports_the_scrape_token_source() {
    const VAR: &str = "KVROUTE_CP_CHECK_SCRAPE_TOKEN";
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cp.yaml");
    let check = |yaml: &str, token: Option<&str>| {
        std::fs::write(&cfg, yaml).unwrap();
        run_check(&cfg, None, &[(VAR, token)])
    };
    let yaml = format!("scrape:\n  token_env: {VAR}\npools: []\n");
    let ingest = "note: ingest token: none found in environment variable `KVROUTE_INGEST_TOKEN`; no targets, so none is needed\n";
    let ok = "config ok: 0 endpoints, 0 targets, listen 127.0.0.1:9090\n";
    assert_eq!(
        check(&yaml, Some("llama-key-0123456789")),
        (
            Some(0),
            format!(
                "{ingest}note: scrape token: found in environment variable `{VAR}` (20 bytes); every scrape carries it\n{ok}"
            ),
            String::new()
        )
    );
    assert_eq!(
        check(&yaml, None),
        (
            Some(0),
            format!(
                "{ingest}note: scrape token: none found in environment variable `{VAR}`: scrapes carry no Authorization, and a model server started with an API key (llama-server `--api-key`) answers them 401\n{ok}"
            ),
            String::new()
        )
    );
    let key = dir.path().join("api-key");
    std::fs::write(&key, "\n").unwrap();
    assert_eq!(
        check(
            &format!("scrape:\n  token_file: {}\npools: []\n", key.display()),
            None
        ),
        (
            Some(2),
            "config NOT ok: 1 error(s)\n".to_owned(),
            format!(
                "kvroute-cp: config field `scrape.token_file` = `{}`: file is empty\n",
                key.display()
            )
        )
    );
    // A pool with its own token: a note of its own, and the shared one says whose
    // scrapes carry it; an unusable pool token file exits 2 naming the pool's field.
    let pool_yaml = |k: &std::path::Path| {
        format!(
            "scrape:\n  token_env: {VAR}\npools:\n  - name: a\n    scrape_token_file: {}\n    endpoints: []\n",
            k.display()
        )
    };
    std::fs::write(&key, "pool-key\n").unwrap();
    assert_eq!(
        check(&pool_yaml(&key), Some("llama-key-0123456789")),
        (
            Some(0),
            format!(
                "{ingest}note: scrape token: found in environment variable `{VAR}` (20 bytes); every scrape of a pool without its own token carries it\n\
                 note: scrape token of pool `a`: found in file `{}` (8 bytes); its scrapes carry it\n{ok}",
                key.display()
            ),
            String::new()
        )
    );
    std::fs::write(&key, "").unwrap();
    assert_eq!(
        check(&pool_yaml(&key), Some("llama-key-0123456789")),
        (
            Some(2),
            "config NOT ok: 1 error(s)\n".to_owned(),
            format!(
                "kvroute-cp: config field `pools[0].scrape_token_file` = `{}`: file is empty\n",
                key.display()
            )
        )
    );
}

/// The documented pairing holds: `examples/control-plane/kvroute-cp.yaml` passes
/// `--check --envoy-config` against every Envoy config in `examples/envoy/` and
/// `examples/envoy/dynamic-module/` (the native build's), with the examples' placeholder
/// token: no errors, and its target is that Envoy's ingest listener.
#[test]
fn shipped_example_passes_check_against_every_shipped_envoy_config() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut envoys: Vec<_> = ["examples/envoy", "examples/envoy/dynamic-module"]
        .iter()
        .flat_map(|d| std::fs::read_dir(root.join(d)).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    envoys.sort();
    assert_eq!(envoys.len(), 4, "{envoys:?}");
    for envoy in &envoys {
        let out = Command::new(BIN)
            .arg("--check")
            .arg("--config")
            .arg(root.join("examples/control-plane/kvroute-cp.yaml"))
            .arg("--envoy-config")
            .arg(envoy)
            .env("KVROUTE_INGEST_TOKEN", "change-me-to-a-long-random-secret")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{}:\n{stdout}", envoy.display());
        assert!(
            !stdout.contains("error:") && !stdout.contains("not an ingest listener port"),
            "{}:\n{stdout}",
            envoy.display()
        );
        // Endpoint mode does not use `cluster`, so clusters are not claimed to match.
        let matched = if envoy.ends_with("cluster-mode.yaml") {
            "kvroute plugin configs, clusters, ingest token, ingest port, ingest path"
        } else {
            "kvroute plugin configs, ingest token, ingest port, ingest path"
        };
        assert!(
            stdout.ends_with(&format!(
                "config ok: 2 endpoints, 1 targets, listen 127.0.0.1:9090; \
                 matches the Envoy config ({matched})\n"
            )),
            "{}:\n{stdout}",
            envoy.display()
        );
    }
}

async fn snapshot_ids(base: &str) -> Vec<String> {
    let Some((status, body)) = try_get(&format!("{base}/v1/snapshot")).await else {
        return Vec::new();
    };
    if status != 200 {
        return Vec::new();
    }
    let snap = kvroute_core::snapshot::Snapshot::decode(body.as_bytes()).unwrap();
    snap.endpoints
        .iter()
        .filter(|e| e.healthy)
        .map(|e| e.id.clone())
        .collect()
}

async fn wait_ids(base: &str, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let ids = snapshot_ids(base).await;
        if ids == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "snapshot ids {ids:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn reload_on_sighup_and_file_change_then_sigterm() {
    let a = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let b = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cp.yaml");
    std::fs::write(&cfg, config_yaml(&[("a", a.addr())], &[], "")).unwrap();
    let port = free_port();
    let child = Command::new(BIN)
        .arg("--config")
        .arg(&cfg)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut guard = Guard(child);
    let base = format!("http://127.0.0.1:{port}");
    wait_ids(&base, &["p/a"]).await;
    // File change (the watcher) picks up b.
    std::fs::write(
        &cfg,
        config_yaml(&[("a", a.addr()), ("b", b.addr())], &[], ""),
    )
    .unwrap();
    wait_ids(&base, &["p/a", "p/b"]).await;
    // An invalid edit is rejected; the running config stays.
    std::fs::write(&cfg, "scrape:\n  jitter: 7\n").unwrap();
    signal(&guard.0, "-HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, m) = get(&format!("{base}/metrics")).await;
        let failures = m
            .lines()
            .find_map(|l| l.strip_prefix("kvroute_cp_config_reload_failures_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if failures >= 1 {
            break;
        }
        assert!(Instant::now() < deadline, "reload failure not counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_ids(&base, &["p/a", "p/b"]).await;
    // SIGHUP with b only.
    std::fs::write(&cfg, config_yaml(&[("b", b.addr())], &[], "")).unwrap();
    signal(&guard.0, "-HUP");
    wait_ids(&base, &["p/b"]).await;
    signal(&guard.0, "-TERM");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = guard.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "kvroute-cp did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(0));
}

/// Out of file descriptors (EMFILE), `accept` fails at once for as long as a connection
/// waits in the backlog. The own-endpoint server must back off instead of retrying in a
/// tight loop (a core at 100 % and a flood of `accept failed` lines), and serve again once
/// descriptors are free.
#[tokio::test]
async fn accept_errors_back_off_instead_of_spinning() {
    let a = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cp.yaml");
    std::fs::write(&cfg, config_yaml(&[("a", a.addr())], &[], "")).unwrap();
    let log = dir.path().join("stdout.log");
    let port = free_port();
    let child = Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -n 64 && exec "$0" --config "$1" --listen "$2""#)
        .arg(BIN)
        .arg(&cfg)
        .arg(format!("127.0.0.1:{port}"))
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _guard = Guard(child);
    let base = format!("http://127.0.0.1:{port}");
    wait_ids(&base, &["p/a"]).await;
    // More idle connections than its descriptor limit: the last ones wait in the backlog.
    let mut held = Vec::new();
    for _ in 0..100 {
        held.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let failed = std::fs::read_to_string(&log)
        .unwrap()
        .matches("accept failed")
        .count();
    assert!(failed >= 1, "the descriptor limit was never reached");
    assert!(
        failed <= 30,
        "{failed} `accept failed` lines in 2 s: the accept loop spins"
    );
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some((200, _)) = try_get(&format!("{base}/healthz")).await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no /healthz once connections closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The shipped Kubernetes config (`deploy/kustomize/kvroute-cp.yaml`, its token file swapped
/// for a local one) passes `--check`, which says what it watches: its endpoints and targets
/// all come from the watches.
#[test]
fn check_names_the_kubernetes_watches() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "a-long-enough-ingest-token").unwrap();
    let yaml = std::fs::read_to_string(root.join("deploy/kustomize/kvroute-cp.yaml"))
        .unwrap()
        .replace("/var/run/kvroute/token/token", &token.display().to_string());
    let cfg = dir.path().join("cp.yaml");
    std::fs::write(&cfg, yaml).unwrap();
    let (code, stdout, stderr) = run_check(&cfg, None, &[]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.ends_with(
            "config ok: 0 endpoints, 0 targets, watches 1 InferencePools and 1 gateway pod sets, listen 0.0.0.0:9090\n"
        ),
        "{stdout}"
    );
}
