//! kvroute tools, each behind its own binary:
//!
//! - [`replay`] (`kvroute-replay`): replays a real trace (Mooncake, Azure LLM inference, ShareGPT)
//!   against any OpenAI-compatible endpoint and reports TTFT, TPOT/ITL and prefix-cache hit rate.
//! - [`routebench`] (`kvroute-bench`): the offline routing benchmark; kvroute and the baselines
//!   (round robin, least request, llm-d's endpoint picker, SGLang's cache-aware router, Dynamo's
//!   KV router) drive the same simulated fleet in virtual time.
//! - [`demo`] (`kvroute-demo`): the end-to-end demo behind `make demo`; simulated or real
//!   llama.cpp backends, the control plane, and Envoy with and without the filter.
//! - [`overhead`] (`kvroute-overhead`): the data-plane overhead benchmark behind
//!   `make bench-overhead`; plain Envoy, a trivial body-buffering Wasm filter and kvroute
//!   side by side under wrk (`docs/overhead.md`).
//!
//! See `docs/replay.md` and `docs/bench.md`.

pub mod callgrind;
pub mod demo;
pub mod overhead;
pub mod replay;
pub mod routebench;
