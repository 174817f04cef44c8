//! kvroute's integration crate: the [`harness`] that starts real Envoy (with the filter's
//! `.wasm`), backends and the control plane on loopback ports for end-to-end tests, and, under
//! `tests/`, the cross-component tests (`filter_*`: the filter inside Envoy; `cp_*`: the control
//! plane against simulated model servers and a real Envoy).
//!
//! The simulator is its own crate (`kvroute-sim`, `sim/`); replay, the routing benchmark and the
//! demo are `kvroute-tools` (`tools/`), which uses this harness to start Envoy.

pub mod harness;
