//! Baseline routers, one file per algorithm, each re-implemented from its published
//! description (written here, not copied; every module doc cites its source and defaults).
//!
//! All of them decide from what a real deployment of that router would see:
//! - [`EndpointView`]: the last snapshot that reached the router (KV usage, waiting and
//!   running requests, scraped every `scrape_interval_ms` and delivered `push_delay_ms`
//!   later) plus router-local in-flight request counts (immediate);
//! - the router's own prefix memory (llm-d, SGLang), or, for NVIDIA Dynamo (KV events) and
//!   the oracle, the engines' true prefix caches passed in by the replay loop.
//!
//! Ties: llm-d's max-score picker breaks ties at random (seeded); the others document theirs.

pub mod dynamo;
pub mod least_request;
pub mod llmd;
pub mod llmd_guide;
pub mod oracle;
pub mod round_robin;
pub mod sglang;

pub use dynamo::DynamoKv;
pub use least_request::LeastRequest;
pub use llmd::LlmdEpp;
pub use llmd_guide::LlmdGuide;
pub use oracle::{Oracle, OracleView};
pub use round_robin::RoundRobin;
pub use sglang::SglangCacheAware;

/// What a snapshot-driven baseline sees of one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EndpointView {
    /// Snapshot KV-cache usage (0..1).
    pub kv_usage: f64,
    /// Snapshot waiting-queue size (requests).
    pub waiting: u32,
    /// Snapshot running requests.
    pub running: u32,
    /// Router-local in-flight requests (sent, not finished; immediate).
    pub inflight: u64,
}

/// Index of the smallest `key` (first on ties); `None` for an empty slice.
pub(crate) fn argmin_by_key<T, K: Ord>(items: &[T], key: impl Fn(&T) -> K) -> Option<usize> {
    items
        .iter()
        .enumerate()
        .min_by_key(|(i, t)| (key(t), *i))
        .map(|(i, _)| i)
}

#[cfg(test)]
pub(crate) fn test_ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("replica-{i}")).collect()
}

#[cfg(test)]
pub(crate) fn view(kv_usage: f64, waiting: u32, inflight: u64) -> EndpointView {
    EndpointView {
        kv_usage,
        waiting,
        running: 0,
        inflight,
    }
}
