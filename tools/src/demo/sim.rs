//! The simulated fleet: N `kvroute-sim` replicas in this process (vLLM V1 metrics).

use super::gateway::Backend;
use super::DemoError;
use kvroute_core::profile::builtin;
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::{spawn_fleet, FleetConfig, FleetError, FleetHandle, ReplicaConfig};
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

/// Model of the default demo: kvroute-core's Llama-3.1-8B profile, which kvroute-sim
/// serves with the `h100-llama-3.1-8b` step-time profile and vLLM's KV sizing on one H100.
pub const DEFAULT_SIM_MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// How long [`start_sims`] retries binding ports the previous run's replicas just released.
pub const REBIND_DEADLINE: Duration = Duration::from_secs(5);

/// Options of [`start_sims`].
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Replicas (1..=1024).
    pub replicas: usize,
    /// A kvroute-core built-in model profile name.
    pub model: String,
    /// Virtual seconds per wall second (1 = real time).
    pub time_scale: f64,
    /// Seed of the default output-length draw (the demo's requests carry exact lengths).
    pub seed: u64,
    /// First port (replica *i* binds `base_port + i`); 0: any free ports.
    pub base_port: u16,
}

/// Start the replicas; returns the fleet (stopped on drop) and one [`Backend`] per replica
/// (`sim-<i>`, kind `vllm`, `http://<addr>/metrics`). Retries for [`REBIND_DEADLINE`] when
/// a port is still held by the previous run's replicas.
pub async fn start_sims(opts: &SimOptions) -> Result<(FleetHandle, Vec<Backend>), DemoError> {
    if opts.replicas == 0 || opts.replicas > 1024 {
        return Err(DemoError::Option {
            option: "--backends",
            value: opts.replicas.to_string(),
            reason: "must be 1..=1024".into(),
        });
    }
    if !(opts.time_scale.is_finite() && opts.time_scale > 0.0) {
        return Err(DemoError::Option {
            option: "--time-scale",
            value: opts.time_scale.to_string(),
            reason: "must be a finite number > 0".into(),
        });
    }
    let profile = builtin(&opts.model).ok_or_else(|| DemoError::Option {
        option: "--model",
        value: opts.model.clone(),
        reason: "not a kvroute-core built-in model profile".into(),
    })?;
    let replica = ReplicaConfig::for_model(profile, Dialect::VllmV1, opts.time_scale, opts.seed)
        .map_err(|e| DemoError::Sim(e.to_string()))?;
    let cfg = FleetConfig {
        replica,
        replicas: opts.replicas,
        bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
        base_port: opts.base_port,
    };
    let deadline = Instant::now() + REBIND_DEADLINE;
    let fleet = loop {
        match spawn_fleet(cfg.clone()).await {
            Ok(f) => break f,
            Err(FleetError::Bind { .. }) if opts.base_port != 0 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(DemoError::Sim(e.to_string())),
        }
    };
    let backends = fleet
        .addrs()
        .iter()
        .enumerate()
        .map(|(i, a)| Backend {
            name: format!("sim-{i}"),
            address: *a,
            metrics_url: format!("http://{a}/metrics"),
            kind: "vllm".into(),
            slots_url: None,
        })
        .collect();
    Ok((fleet, backends))
}
