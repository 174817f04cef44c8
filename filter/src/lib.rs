//! # kvroute-filter
//!
//! The proxy-wasm HTTP filter that routes OpenAI-style requests by KV-cache stats inside
//! Envoy (and Istio via EnvoyFilter). Thin glue over `kvroute-core`:
//!
//! | module | job |
//! |---|---|
//! | [`host`] | the host seam (trait), and `period_passed` for periodic work on its wall clock; its in-memory mock only under `cfg(test)` or the `testing` feature |
//! | [`headers`] | a header map as the host serializes it, read in place (bytes, never assumed UTF-8) |
//! | [`names`] | every header, shared-data key and metric name |
//! | [`reply`] | every reply the filter makes itself (OpenAI error object, `GET /v1/models`) |
//! | [`shared`] | snapshot publication/cache, the keys updated with CAS, the worker counter |
//! | [`inflight`] | each worker's in-flight reservations, published to and read from the other workers |
//! | [`sharing`] | the journals the workers share on their tick: prefix affinity, learner observations |
//! | [`ingest`] | role `ingest`: the upload checks, its stream type, the shared-queue consumer |
//! | [`router`] | role `route`: per-worker state, host I/O around `kvroute_core::router::Router`, applying a decision, admission tick |
//! | [`stream`] | role `route`: the per-request state machine (request pause/decide, response usage) |
//! | `wasm` | proxy-wasm contexts and the real host (wasm32 only) |
//!
//! The plugin configuration (JSON → validated `Config`) is `kvroute_core::plugin_config`,
//! shared with `kvroute-cp --check`.
//!
//! See `docs/filter.md` for the data flow and the README for configuration.

#[cfg(target_arch = "wasm32")]
mod abi;
pub mod headers;
pub mod host;
pub mod inflight;
pub mod ingest;
pub mod names;
pub mod reply;
pub mod router;
pub mod shared;
pub mod sharing;
pub mod stream;
#[cfg(target_arch = "wasm32")]
mod wasm;
