//! # kvroute-dynmod
//!
//! kvroute's HTTP filter as an Envoy dynamic module: a native shared library
//! (`libkvroute_dynmod.so`) loaded by Envoy's `DynamicModuleFilter`, instead of the
//! proxy-wasm `.wasm` in a V8 VM. The routing glue is kvroute-filter's own, unchanged
//! ([`kvroute_filter::stream::Stream`], [`kvroute_filter::router::Worker`],
//! [`kvroute_filter::ingest`]); this crate only implements its host seam
//! ([`kvroute_filter::host::Host`]) over the dynamic-module ABI.
//!
//! | module | job |
//! |---|---|
//! | `abi` | the only `unsafe` module: Envoy callback declarations, safe wrappers, the exported hooks |
//! | `guard` | the panic barrier every hook runs in (fail open) |
//! | `glue` | per-config and per-stream state, the `Host` implementation, the process-wide shared data, the admission ticker |
//!
//! See `docs/dynamic-module.md` for loading it and for what differs from the Wasm filter.

mod abi;
mod glue;
mod guard;
