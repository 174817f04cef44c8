//! kvroute-sim: a vLLM-compatible model-server simulator (issue 4).
//!
//! - [`kv`]: paged KV cache with hash-chained automatic prefix caching and LRU eviction.
//! - [`perf`]: step-time model (Vidur-style roofline) and KV pool sizing per GPU/model.
//! - [`engine`]: vLLM V1-like scheduler in virtual time (continuous batching, chunked
//!   prefill, FCFS or priority queue, preemption by recompute).
//! - [`metrics`]: `/metrics` in the vLLM V1, vLLM V0, SGLang and llama.cpp dialects.
//! - [`api`]: OpenAI request parsing (incl. the `kvroute_sim` extension) and response bodies.
//! - [`body`]: a streamed response body fed through a channel that never drops its last frame.
//! - [`server`]: hyper HTTP server; [`server::spawn_fleet`] runs N replicas in-process.
//! - [`trace`]: Mooncake trace loading and offline replay through the engine.
//!
//! See `docs/sim.md` for the model, its parameters and sources, and the known differences
//! from real vLLM.

pub mod api;
pub mod body;
pub mod engine;
pub mod kv;
pub mod metrics;
pub mod perf;
pub mod server;
pub mod trace;
