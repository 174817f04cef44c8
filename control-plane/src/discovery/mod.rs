//! Discovery: where endpoints (model-server replicas) and push targets (gateway pods) come
//! from. One file per source:
//!
//! - the static lists of the config file (`pools:`, `targets:`), replaced on reload;
//! - [`kubernetes`]: InferencePools and their ready pods, watched through the Kubernetes
//!   API (kube-rs), with models from each pod's `/v1/models` ([`models`]);
//! - [`gateways`]: gateway pods selected by labels, each a push target, so every replica
//!   gets every snapshot (a Service would reach one pod per push).
//!
//! Each source owns one named slot of a [`Merged`] set; the set published on a
//! `tokio::sync::watch` channel is the union of all slots, in slot-name order. The
//! supervisor ([`crate::app`]) diffs consecutive sets and starts/stops scrape and push
//! tasks, so pods joining, leaving or changing address change the fleet without a restart.

pub mod api_guard;
pub mod gateways;
pub mod kubernetes;
pub mod models;
pub mod pod;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// A set published as the union of named slots, one per discovery source.
///
/// Items are de-duplicated by `key` (first slot in name order wins), so a pod named by two
/// sources is scraped once.
pub struct Merged<T> {
    slots: Mutex<BTreeMap<String, Vec<T>>>,
    tx: watch::Sender<Arc<Vec<T>>>,
    key: fn(&T) -> &str,
}

impl<T: Clone + PartialEq> Merged<T> {
    /// An empty set; `key` names an item (endpoint id, target name).
    pub fn new(key: fn(&T) -> &str) -> Self {
        let (tx, _) = watch::channel(Arc::new(Vec::new()));
        Self {
            slots: Mutex::new(BTreeMap::new()),
            tx,
            key,
        }
    }

    /// Replace slot `source` with `items` and publish the union (nothing is published when
    /// the union is unchanged).
    pub fn set(&self, source: &str, items: Vec<T>) {
        let mut slots = self
            .slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if items.is_empty() {
            slots.remove(source);
        } else {
            slots.insert(source.to_owned(), items);
        }
        let mut seen = std::collections::BTreeSet::new();
        let union: Vec<T> = slots
            .values()
            .flatten()
            .filter(|t| seen.insert((self.key)(t).to_owned()))
            .cloned()
            .collect();
        drop(slots);
        self.tx.send_if_modified(|cur| {
            if **cur == union {
                false
            } else {
                *cur = Arc::new(union);
                true
            }
        });
    }

    /// Drop every slot whose name starts with `prefix` (a source being stopped).
    pub fn clear_prefix(&self, prefix: &str) {
        let names: Vec<String> = self
            .slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        for n in names {
            self.set(&n, Vec::new());
        }
    }

    /// Receiver of the current union; changes when the union changes.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Vec<T>>> {
        self.tx.subscribe()
    }

    /// The current union.
    pub fn current(&self) -> Arc<Vec<T>> {
        self.tx.borrow().clone()
    }
}

/// Slot name of the config file's static lists.
pub const STATIC_SLOT: &str = "0-static";
