//! # kvroute-core
//!
//! The pure routing logic of kvroute, shared by the proxy-wasm filter (`kvroute-filter`),
//! the control plane (`kvroute-cp`), the simulator (`kvroute-sim`) and the tools (`kvroute-tools`).
//!
//! Nothing here depends on proxy-wasm, tokio, a clock or an OS random source: callers pass
//! the current time (`now_ms`, Unix milliseconds) and a seed. The crate builds natively and
//! for `wasm32-wasip1` / `wasm32-unknown-unknown`, and behaves identically on both.
//!
//! Pipeline of one routing decision, run by [`router::Router`] (the one implementation the
//! filter and the benchmarks call):
//! 1. [`analysis::analyze`] reads an OpenAI-style body into a [`analysis::RequestAnalysis`]
//!    (model, stream, n, output limit, estimated prompt tokens, text for prefix hashing).
//! 2. [`profile::ModelProfile::demand`] turns that into KV demand (tokens and bytes).
//! 3. [`prefix::block_hashes`] hashes the prefix text into a chain of block hashes, matched
//!    against the per-endpoint record of routed prefixes ([`prefix::PrefixIndex`]).
//! 4. [`picker::Picker::pick`] chooses a primary endpoint and ordered fallbacks from a
//!    [`snapshot::Snapshot`] plus the in-flight reservations ([`inflight::InflightTable`]).
//!
//! [`plugin_config`] is the filter's plugin configuration, here so that the control plane's
//! `--check` validates an Envoy config's kvroute plugins with the filter's own rules.

pub mod admission;
pub mod affinity;
pub mod analysis;
pub mod echo;
pub mod estimate;
pub mod inflight;
mod json_scan;
pub mod observation;
pub mod output_len;
pub mod peer;
pub mod percentile;
pub mod picker;
pub mod plugin_config;
pub mod prefill_rate;
pub mod prefix;
pub mod profile;
pub mod router;
pub mod shared_data;
// Built only where it has a body: Wasm SIMD or x86-64's SSE2 (see the module's docs).
#[cfg(any(
    all(target_arch = "wasm32", target_feature = "simd128"),
    all(target_arch = "x86_64", target_feature = "sse2")
))]
mod simd;
pub mod snapshot;
pub mod usage;
pub mod usage_sample;
