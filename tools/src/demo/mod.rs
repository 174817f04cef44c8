//! `kvroute-demo`: the whole product on real traffic (issue 6). Starts a fleet of model
//! servers, kvroute-cp and Envoy with the kvroute filter, replays a real trace through it
//! with `kvroute-replay` ([`crate::replay`]), then does the same through Envoy's own
//! `ROUND_ROBIN` over the same backends, and prints both side by side.
//!
//! ## Stacks
//! - **Simulated** ([`sim`]): N `kvroute-sim` replicas (in this process, one port each,
//!   vLLM V1 metrics, the H100 / Llama-3.1-8B step-time profile) time-scaled by
//!   `time_scale` virtual seconds per wall second; the trace's send times are divided by the
//!   same factor, so the load per virtual second is the trace's.
//! - **Real** ([`llama`]): `llama-server` child processes (llama.cpp, CPU, SmolLM2-135M),
//!   `--metrics`, 4 slots each, read by kvroute-cp through its `llamacpp` adapter and `/slots`.
//!
//! In front of either, [`gateway::Gateway`] starts kvroute-cp (in this process) and Envoy
//! (a child process): in [`gateway::Routing::Kvroute`] mode Envoy runs the filter in cluster
//! mode (one Envoy cluster per backend) and kvroute-cp pushes snapshots to the filter's ingest
//! listener; in [`gateway::Routing::RoundRobin`] mode Envoy has one `ROUND_ROBIN` cluster over
//! the same backends and no filter. Both add `x-kvroute-upstream: %UPSTREAM_REMOTE_ADDRESS%`
//! to every response ([`BACKEND_HEADER`]) so the replay knows which backend served.
//!
//! ## Cold caches for both runs
//! Each run gets a fresh stack: backends, kvroute-cp and Envoy are stopped after the first
//! run and started again (same ports) for the second, so both start with empty prefix
//! caches and the comparison is fair ([`run::run_demo`]).
//!
//! ## Cleanup
//! Simulators and kvroute-cp live in this process and end with it. Envoy and llama-server
//! are children held by [`kvroute_integration::harness::ChildGuard`] (SIGKILL + reap on drop). The binary
//! races the demo against Ctrl-C / SIGTERM ([`signal::shutdown_signal`]); on a signal the
//! demo future is dropped, which drops every guard before the process exits. Ports are
//! checked before anything starts ([`ports::check_ports`]): a taken port is refused with its
//! number, its role and the flag that changes it.

pub mod gateway;
pub mod llama;
pub mod ports;
pub mod run;
pub mod signal;
pub mod sim;

/// Response header that names the backend that served a request (`host:port`), added by
/// the demo's Envoy configs from `%UPSTREAM_REMOTE_ADDRESS%`.
pub const BACKEND_HEADER: &str = "x-kvroute-upstream";

/// Errors of the demo. Each names what to change.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A configured port is taken.
    #[error(
        "port {port} ({role}) is already in use: {os_error}. Free it or pick other ports with {flag}"
    )]
    PortInUse {
        /// The port.
        port: u16,
        /// What the demo wanted it for.
        role: String,
        /// The flag / Makefile variable that changes it.
        flag: &'static str,
        /// The bind error (not a `source`: it is part of the message).
        os_error: std::io::Error,
    },
    /// A bad option value.
    #[error("invalid option {option}={value}: {reason}")]
    Option {
        /// The option.
        option: &'static str,
        /// Its value.
        value: String,
        /// Why.
        reason: String,
    },
    /// Envoy did not start or its admin API failed.
    #[error(transparent)]
    Envoy(#[from] kvroute_integration::harness::EnvoyError),
    /// kvroute-cp did not start.
    #[error("kvroute-cp: {0}")]
    ControlPlane(String),
    /// The simulators did not start.
    #[error("kvroute-sim: {0}")]
    Sim(String),
    /// llama-server or its model is missing or did not start.
    #[error("llama-server: {0}")]
    Llama(String),
    /// The replay failed to set up or to write its report.
    #[error(transparent)]
    Replay(#[from] crate::replay::ReplayError),
    /// A stack did not become ready (names what was awaited).
    #[error("not ready: {0}")]
    NotReady(String),
    /// File I/O.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}
