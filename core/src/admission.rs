//! Bounded admission queue for requests that found every endpoint saturated.
//!
//! When admission control is on and the picker answers
//! [`crate::picker::PickOutcome::NoCapacity`], the filter parks the request here instead of
//! overloading a model server. Order of service:
//! 1. `priority` ascending — vLLM's convention, where a lower value is served earlier
//!    (`priority` request field, vLLM `--scheduling-policy priority`);
//! 2. then estimated job size ascending (shortest job first, which minimises mean waiting
//!    time; Smith's rule, also the basis of SGLang's and llm-d's queue-aware scoring);
//! 3. then arrival order (FIFO among equals, so no starvation within a class).
//!
//! The queue holds at most `capacity` entries: a push into a full queue is refused and the
//! caller answers 429 at once. Entries older than the caller's timeout are removed by
//! [`AdmissionQueue::take_expired`] (the filter answers those with 429 + `retry-after`).
//! Time is passed in (`now_ms`), never read here.

use std::collections::BTreeMap;

/// Why a push was refused; carries the item back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("admission queue is full ({capacity} entries)")]
pub struct QueueFull<T> {
    /// The item that was not queued.
    pub item: T,
    /// The queue's capacity.
    pub capacity: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry<T> {
    item: T,
    enqueued_at_ms: u64,
}

/// Bounded priority queue ordered by (priority, size, arrival).
#[derive(Debug, Clone)]
pub struct AdmissionQueue<T> {
    capacity: usize,
    seq: u64,
    entries: BTreeMap<(i32, u64, u64), Entry<T>>,
}

impl<T> AdmissionQueue<T> {
    /// An empty queue holding at most `capacity` items (0 refuses everything).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            seq: 0,
            entries: BTreeMap::new(),
        }
    }

    /// Items queued.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Capacity given at construction.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Queue `item` with vLLM `priority` (lower first) and estimated `size` (tokens; smaller
    /// first). Errors: [`QueueFull`] when at capacity.
    pub fn push(
        &mut self,
        item: T,
        priority: i32,
        size: u64,
        now_ms: u64,
    ) -> Result<(), QueueFull<T>> {
        if self.entries.len() >= self.capacity {
            return Err(QueueFull {
                item,
                capacity: self.capacity,
            });
        }
        self.seq = self.seq.wrapping_add(1);
        self.entries.insert(
            (priority, size, self.seq),
            Entry {
                item,
                enqueued_at_ms: now_ms,
            },
        );
        Ok(())
    }

    /// The next item to serve, without removing it.
    pub fn peek(&self) -> Option<&T> {
        self.entries.values().next().map(|e| &e.item)
    }

    /// Remove and return the next item to serve.
    pub fn pop(&mut self) -> Option<T> {
        self.entries.pop_first().map(|(_, e)| e.item)
    }

    /// Remove and return (in service order) every item queued at or before
    /// `now_ms - timeout_ms`.
    pub fn take_expired(&mut self, now_ms: u64, timeout_ms: u64) -> Vec<T> {
        let cutoff = now_ms.saturating_sub(timeout_ms);
        let expired: Vec<(i32, u64, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.enqueued_at_ms <= cutoff && now_ms >= timeout_ms)
            .map(|(k, _)| *k)
            .collect();
        expired
            .into_iter()
            .filter_map(|k| self.entries.remove(&k).map(|e| e.item))
            .collect()
    }

    /// Remove the first item (in service order) matching `pred` (e.g. a client that went
    /// away while queued). Returns it.
    pub fn remove_where(&mut self, mut pred: impl FnMut(&T) -> bool) -> Option<T> {
        let key = self
            .entries
            .iter()
            .find(|(_, e)| pred(&e.item))
            .map(|(k, _)| *k)?;
        self.entries.remove(&key).map(|e| e.item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn orders_by_priority_then_size_then_arrival() {
        let mut q = AdmissionQueue::new(10);
        q.push("big-p0", 0, 900, 0).unwrap();
        q.push("small-p0", 0, 10, 1).unwrap();
        q.push("urgent", -1, 5000, 2).unwrap();
        q.push("small-p0-later", 0, 10, 3).unwrap();
        q.push("low", 5, 1, 4).unwrap();
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            order,
            ["urgent", "small-p0", "small-p0-later", "big-p0", "low"]
        );
    }

    #[test]
    fn refuses_when_full_and_returns_the_item() {
        let mut q = AdmissionQueue::new(1);
        q.push(1, 0, 0, 0).unwrap();
        assert_eq!(
            q.push(2, 0, 0, 0),
            Err(QueueFull {
                item: 2,
                capacity: 1
            })
        );
        let mut z: AdmissionQueue<u8> = AdmissionQueue::new(0);
        assert!(z.push(1, 0, 0, 0).is_err());
    }

    #[test]
    fn take_expired_takes_only_old_items() {
        let mut q = AdmissionQueue::new(10);
        q.push("a", 0, 1, 1000).unwrap();
        q.push("b", 0, 2, 1500).unwrap();
        q.push("c", 0, 3, 2000).unwrap();
        assert_eq!(q.take_expired(2499, 1000), vec!["a"]);
        assert_eq!(q.take_expired(2500, 1000), vec!["b"]);
        assert_eq!(q.len(), 1);
        assert_eq!(q.take_expired(10, 1000), Vec::<&str>::new());
    }

    #[test]
    fn remove_where_removes_one() {
        let mut q = AdmissionQueue::new(10);
        q.push(7u32, 0, 1, 0).unwrap();
        q.push(8u32, 0, 2, 0).unwrap();
        assert_eq!(q.remove_where(|x| *x == 8), Some(8));
        assert_eq!(q.remove_where(|x| *x == 8), None);
        assert_eq!(q.peek(), Some(&7));
    }

    proptest! {
        /// Pops come out sorted by (priority, size) and never exceed capacity.
        #[test]
        fn pops_sorted(items in proptest::collection::vec((-3i32..3, 0u64..100), 0..50), cap in 0usize..40) {
            let mut q = AdmissionQueue::new(cap);
            let mut accepted = 0;
            for (i, (p, s)) in items.iter().enumerate() {
                if q.push((*p, *s, i), *p, *s, 0).is_ok() { accepted += 1; }
                prop_assert!(q.len() <= cap);
            }
            prop_assert_eq!(accepted, items.len().min(cap));
            let out: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
            for w in out.windows(2) {
                prop_assert!((w[0].0, w[0].1, w[0].2) <= (w[1].0, w[1].1, w[1].2));
            }
        }
    }
}
