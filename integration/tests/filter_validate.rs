//! Every shipped Envoy config in `examples/envoy/` passes `envoy --mode validate` (and has
//! the decision record on, printed by its access log), and a bad plugin configuration is
//! refused by `on_configure` with one clear log line. The harness reports an Envoy that
//! died with its exit status and log.

use kvroute_integration::harness::kvroute::{ingest_plugin_config, EXAMPLE_WASM};
use kvroute_integration::harness::{render, templates, wasm_path, workspace_root, Envoy};

#[test]
fn every_example_config_validates() {
    let dir = workspace_root().join("examples").join("envoy");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "cluster-mode.yaml",
            "endpoint-mode.yaml",
            "endpoint-original-dst.yaml"
        ]
    );
    let wasm = wasm_path();
    assert!(wasm.is_file(), "build the filter first: {}", wasm.display());
    for f in files {
        let yaml = std::fs::read_to_string(&f).unwrap();
        assert!(yaml.contains(EXAMPLE_WASM), "{}", f.display());
        assert!(
            yaml.contains("allow_on_headers_stop_iteration: true"),
            "{}",
            f.display()
        );
        // The decision record is on in every example, and its access log prints it
        // (README, "Explainable"; docs/filter.md, "Decision record").
        assert!(
            yaml.contains(r#""decision_record":true"#),
            "{}",
            f.display()
        );
        assert!(
            yaml.contains("%FILTER_STATE(wasm.kvroute_decision:PLAIN)%"),
            "{}",
            f.display()
        );
        // Removed when dropped; a refusal's message carries Envoy's own output.
        let out = tempfile::Builder::new()
            .prefix("kvroute-validate-")
            .suffix(&format!("-{}", f.file_name().unwrap().to_string_lossy()))
            .tempfile()
            .unwrap()
            .into_temp_path();
        std::fs::write(
            &out,
            yaml.replace(EXAMPLE_WASM, &wasm.display().to_string()),
        )
        .unwrap();
        Envoy::validate(&out).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn validate_rejects_a_broken_config() {
    let out = tempfile::Builder::new()
        .prefix("kvroute-validate-bad-")
        .suffix(".yaml")
        .tempfile()
        .unwrap()
        .into_temp_path();
    std::fs::write(&out, "static_resources: {listeners: [{name: x}]}\n").unwrap();
    assert!(Envoy::validate(&out).is_err());
}

#[tokio::test]
async fn bad_plugin_config_is_refused_with_one_clear_line() {
    // Started on free ports (again on new ones if one was taken), so the error that comes
    // back is the config's.
    let err = Envoy::start_on_free_ports(1, |[listen, ingest]| {
        let wasm = wasm_path();
        let mut vars = vec![
            ("LISTEN_PORT", listen.to_string()),
            ("INGEST_PORT", ingest.to_string()),
            ("BUFFER_LIMIT", "1048576".into()),
            ("CLUSTER_HEADER", "x-kvroute-cluster".into()),
            ("DEFAULT_CLUSTER", "default".into()),
            (
                "CLUSTERS",
                templates::static_cluster("default", &["127.0.0.1:9".into()]),
            ),
        ];
        vars.extend(templates::kvroute_filters(
            templates::FilterModule::Wasm(&wasm),
            r#"{"max_body_bytes":0}"#,
            &ingest_plugin_config(),
        ));
        render(templates::CLUSTER_MODE, &vars)
    })
    .await
    .unwrap_err();
    let err = format!("{err:#}");
    let line = "kvroute plugin config field `max_body_bytes` = 0: must be at least 1";
    assert_eq!(err.matches(line).count(), 1, "{err}");
}

#[tokio::test]
async fn a_killed_envoy_reports_its_exit_and_log() {
    let yaml = "admin:\n  address:\n    socket_address: {address: 127.0.0.1, port_value: 0}\n";
    let mut envoy = Envoy::start(yaml, 1).await.unwrap();
    assert!(envoy.exit_error().is_none());
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &envoy.pid().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let err = loop {
        if let Some(e) = envoy.exit_error() {
            break e.to_string();
        }
        assert!(std::time::Instant::now() < deadline, "still running");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert!(
        err.starts_with("envoy not ready: exited with signal: 9"),
        "{err}"
    );
    // The tail is Envoy's own log: its start-up lines are there.
    assert!(err.contains("--- envoy log tail ---\n"), "{err}");
    assert!(err.contains("starting main dispatch loop"), "{err}");
    assert!(envoy.stats().await.is_err());
}
