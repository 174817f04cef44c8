//! # kvroute-filter
//!
//! The proxy-wasm HTTP filter that routes OpenAI-style requests by KV-cache stats inside
//! Envoy (and Istio via EnvoyFilter). Thin glue over `kvroute-core`:
//!
//! | module | job |
//! |---|---|
//! | [`config`] | plugin JSON → validated [`config::Config`] |
//! | [`host`] | the host seam (trait) and an in-memory mock for native tests |
//! | [`names`] | every header, shared-data key and metric name |
//! | [`reply`] | every reply the filter makes itself (OpenAI error object, `GET /v1/models`) |
//! | [`shared`] | snapshot publication/cache and the in-flight table in shared data (CAS) |
//! | [`ingest`] | the snapshot ingest route (role `ingest`) |
//! | [`router`] | per-worker state, the decision, reservations, admission tick, calibration |
//! | [`stream`] | the per-request state machine (request pause/decide, response usage) |
//! | `wasm` | proxy-wasm contexts and the real host (wasm32 only) |
//!
//! See `docs/filter.md` for the data flow and the README for configuration.

pub mod config;
pub mod host;
pub mod ingest;
pub mod names;
pub mod reply;
pub mod router;
pub mod shared;
pub mod stream;
#[cfg(target_arch = "wasm32")]
mod wasm;
