//! Endpoint discovery behind a trait, so Kubernetes discovery (InferencePool / EndpointSlice
//! watch, a later issue) slots in next to the static list.
//!
//! A discovery source publishes the whole endpoint set on a `tokio::sync::watch` channel;
//! the supervisor diffs consecutive sets and starts/stops scrape tasks.

use crate::config::EndpointSpec;
use std::sync::Arc;
use tokio::sync::watch;

/// A source of endpoints.
pub trait Discovery: Send + Sync {
    /// Receiver of the current endpoint set; changes when the set changes.
    fn subscribe(&self) -> watch::Receiver<Arc<Vec<EndpointSpec>>>;
}

/// The static list from the config file; [`StaticDiscovery::set`] replaces it on reload.
pub struct StaticDiscovery {
    tx: watch::Sender<Arc<Vec<EndpointSpec>>>,
}

impl StaticDiscovery {
    /// Start with `endpoints`.
    pub fn new(endpoints: Vec<EndpointSpec>) -> Self {
        let (tx, _) = watch::channel(Arc::new(endpoints));
        Self { tx }
    }

    /// Replace the list (no-op when equal).
    pub fn set(&self, endpoints: Vec<EndpointSpec>) {
        self.tx.send_if_modified(|cur| {
            if **cur == endpoints {
                false
            } else {
                *cur = Arc::new(endpoints);
                true
            }
        });
    }
}

impl Discovery for StaticDiscovery {
    fn subscribe(&self) -> watch::Receiver<Arc<Vec<EndpointSpec>>> {
        self.tx.subscribe()
    }
}
