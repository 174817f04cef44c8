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
//! Two bounds, both checked at push: at most `capacity` entries, and at most `max_bytes`
//! bytes held in all (each entry's byte count is given at push: the filter passes the size
//! of the request body and path it copies, since parked bodies are what grow a worker's
//! Wasm memory, which never shrinks). A push that would pass either bound is refused with
//! the item handed back ([`QueueFull`]), and the caller answers 429 at once. The held byte
//! count is kept as a running total: added at push, subtracted by the one private removal
//! path that `pop`, `take_expired` and `remove_where` all go through, so it always equals the
//! sum of the held entries' sizes (property test `held_bytes_is_the_sum_and_bounded`).
//! Entries older than the caller's timeout are removed by [`AdmissionQueue::take_expired`]
//! (the filter answers those with 429 + `retry-after`). Time is passed in (`now_ms`), never
//! read here.

use std::collections::BTreeMap;

/// Which bound refused a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// The queue already held `capacity` entries.
    Entries {
        /// The queue's capacity, entries.
        capacity: usize,
    },
    /// The item's bytes on top of those held would pass `max_bytes`.
    Bytes {
        /// The queue's byte bound, bytes.
        max_bytes: usize,
        /// Bytes held when the push was refused.
        held_bytes: usize,
        /// The refused item's bytes.
        item_bytes: usize,
    },
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bound::Entries { capacity } => write!(f, "{capacity} entries"),
            Bound::Bytes {
                max_bytes,
                held_bytes,
                item_bytes,
            } => write!(
                f,
                "{held_bytes} of {max_bytes} bytes held, {item_bytes} more do not fit"
            ),
        }
    }
}

/// Why a push was refused; carries the item back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("admission queue is full ({bound})")]
pub struct QueueFull<T> {
    /// The item that was not queued.
    pub item: T,
    /// The bound it would have passed.
    pub bound: Bound,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry<T> {
    item: T,
    enqueued_at_ms: u64,
    /// Bytes given at push, bytes.
    bytes: usize,
}

/// Service-order key: (priority, size, arrival sequence).
type Key = (i32, u64, u64);

/// Priority queue ordered by (priority, size, arrival), bounded by entries and by bytes.
#[derive(Debug, Clone)]
pub struct AdmissionQueue<T> {
    capacity: usize,
    max_bytes: usize,
    held_bytes: usize,
    seq: u64,
    entries: BTreeMap<Key, Entry<T>>,
}

impl<T> AdmissionQueue<T> {
    /// An empty queue holding at most `capacity` items (0 refuses everything) whose byte
    /// counts add up to at most `max_bytes` bytes (0 admits only items of 0 bytes).
    pub fn new(capacity: usize, max_bytes: usize) -> Self {
        Self {
            capacity,
            max_bytes,
            held_bytes: 0,
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

    /// Capacity given at construction, entries.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Byte bound given at construction, bytes.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Sum of the byte counts of the items queued, bytes (at most [`Self::max_bytes`]).
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Whether an item of `bytes` would be queued now, checked as [`Self::push`] checks it
    /// (so a caller can skip building an item that would be refused). `Ok`: the bytes held
    /// after such a push.
    /// Errors: the [`Bound`] it would pass, [`Bound::Entries`] first.
    pub fn admits(&self, bytes: usize) -> Result<usize, Bound> {
        if self.entries.len() >= self.capacity {
            return Err(Bound::Entries {
                capacity: self.capacity,
            });
        }
        match self.held_bytes.checked_add(bytes) {
            Some(total) if total <= self.max_bytes => Ok(total),
            _ => Err(Bound::Bytes {
                max_bytes: self.max_bytes,
                held_bytes: self.held_bytes,
                item_bytes: bytes,
            }),
        }
    }

    /// Queue `item` with vLLM `priority` (lower first), estimated `size` (tokens; smaller
    /// first) and `bytes` (what holding it costs, bytes; counted against `max_bytes`).
    /// Errors: [`QueueFull`] with [`Bound::Entries`] when at capacity, else with
    /// [`Bound::Bytes`] when `bytes` on top of those held would pass `max_bytes`.
    pub fn push(
        &mut self,
        item: T,
        priority: i32,
        size: u64,
        bytes: usize,
        now_ms: u64,
    ) -> Result<(), QueueFull<T>> {
        let held_bytes = match self.admits(bytes) {
            Ok(total) => total,
            Err(bound) => return Err(QueueFull { item, bound }),
        };
        self.seq = self.seq.wrapping_add(1);
        self.entries.insert(
            (priority, size, self.seq),
            Entry {
                item,
                enqueued_at_ms: now_ms,
                bytes,
            },
        );
        self.held_bytes = held_bytes;
        Ok(())
    }

    /// The next item to serve, without removing it.
    pub fn peek(&self) -> Option<&T> {
        self.entries.values().next().map(|e| &e.item)
    }

    /// The next item to serve, mutably, without removing it: a caller can move its
    /// contents out while it works on them and put them back, with no copy (its byte count,
    /// given at push, stays what it was).
    pub fn peek_mut(&mut self) -> Option<&mut T> {
        self.entries.values_mut().next().map(|e| &mut e.item)
    }

    /// Remove and return the next item to serve.
    pub fn pop(&mut self) -> Option<T> {
        let key = *self.entries.keys().next()?;
        self.take(&key)
    }

    /// Remove and return (in service order) every item queued at or before
    /// `now_ms - timeout_ms`.
    pub fn take_expired(&mut self, now_ms: u64, timeout_ms: u64) -> Vec<T> {
        let cutoff = now_ms.saturating_sub(timeout_ms);
        let expired: Vec<Key> = self
            .entries
            .iter()
            .filter(|(_, e)| e.enqueued_at_ms <= cutoff && now_ms >= timeout_ms)
            .map(|(k, _)| *k)
            .collect();
        expired.iter().filter_map(|k| self.take(k)).collect()
    }

    /// Remove the first item (in service order) matching `pred` (e.g. a client that went
    /// away while queued). Returns it.
    pub fn remove_where(&mut self, mut pred: impl FnMut(&T) -> bool) -> Option<T> {
        let key = self
            .entries
            .iter()
            .find(|(_, e)| pred(&e.item))
            .map(|(k, _)| *k)?;
        self.take(&key)
    }

    /// The one removal path: every item leaves through here, so the held byte count loses
    /// exactly what its push added.
    fn take(&mut self, key: &Key) -> Option<T> {
        let e = self.entries.remove(key)?;
        self.held_bytes = self.held_bytes.saturating_sub(e.bytes);
        Some(e.item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// No byte bound: the tests of order and expiry push items of 0 bytes.
    fn unbounded<T>(capacity: usize) -> AdmissionQueue<T> {
        AdmissionQueue::new(capacity, usize::MAX)
    }

    #[test]
    fn orders_by_priority_then_size_then_arrival() {
        let mut q = unbounded(10);
        q.push("big-p0", 0, 900, 0, 0).unwrap();
        q.push("small-p0", 0, 10, 0, 1).unwrap();
        q.push("urgent", -1, 5000, 0, 2).unwrap();
        q.push("small-p0-later", 0, 10, 0, 3).unwrap();
        q.push("low", 5, 1, 0, 4).unwrap();
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            order,
            ["urgent", "small-p0", "small-p0-later", "big-p0", "low"]
        );
    }

    #[test]
    fn refuses_when_full_and_returns_the_item() {
        let mut q = unbounded(1);
        q.push(1, 0, 0, 0, 0).unwrap();
        assert_eq!(
            q.push(2, 0, 0, 0, 0),
            Err(QueueFull {
                item: 2,
                bound: Bound::Entries { capacity: 1 }
            })
        );
        let mut z: AdmissionQueue<u8> = unbounded(0);
        assert_eq!(
            z.push(1, 0, 0, 0, 0),
            Err(QueueFull {
                item: 1,
                bound: Bound::Entries { capacity: 0 }
            })
        );
    }

    /// A push whose bytes would pass the bound is refused with the item; what is popped,
    /// expired or removed gives its bytes back, and an item that fits exactly is taken.
    #[test]
    fn byte_bound_refuses_what_would_pass_it() {
        let mut q = AdmissionQueue::new(10, 100);
        q.push("a", 0, 1, 60, 0).unwrap();
        assert_eq!(
            q.push("b", 0, 2, 41, 0),
            Err(QueueFull {
                item: "b",
                bound: Bound::Bytes {
                    max_bytes: 100,
                    held_bytes: 60,
                    item_bytes: 41
                }
            })
        );
        assert_eq!((q.len(), q.held_bytes()), (1, 60));
        assert_eq!(q.admits(40), Ok(100));
        assert_eq!(
            q.admits(41),
            Err(Bound::Bytes {
                max_bytes: 100,
                held_bytes: 60,
                item_bytes: 41
            })
        );
        q.push("c", 0, 3, 40, 1).unwrap();
        // Full to the byte: only items of 0 bytes still fit.
        q.push("d", 0, 4, 0, 2).unwrap();
        assert_eq!((q.len(), q.held_bytes()), (3, 100));
        assert!(q.push("e", 0, 5, 1, 3).is_err());
        assert_eq!(q.pop(), Some("a"));
        assert_eq!(q.held_bytes(), 40);
        assert_eq!(q.remove_where(|x| *x == "d"), Some("d"));
        assert_eq!(q.held_bytes(), 40);
        assert_eq!(q.take_expired(1, 0), vec!["c"]);
        assert_eq!((q.len(), q.held_bytes()), (0, 0));
        // The bytes freed let a push through that was refused before.
        q.push("b", 0, 2, 100, 5).unwrap();
        assert_eq!(q.held_bytes(), 100);
    }

    /// The entry bound is checked first; a byte count that would overflow is refused, not
    /// wrapped; a bound of 0 bytes admits only items of 0 bytes.
    #[test]
    fn byte_bound_edges() {
        let mut q = AdmissionQueue::new(1, 10);
        q.push(1u8, 0, 0, 10, 0).unwrap();
        assert_eq!(
            q.push(2, 0, 0, 5, 0).unwrap_err().bound,
            Bound::Entries { capacity: 1 }
        );
        let mut q = AdmissionQueue::new(4, usize::MAX);
        q.push(1u8, 0, 0, 1, 0).unwrap();
        assert_eq!(
            q.push(2, 0, 0, usize::MAX, 0).unwrap_err().bound,
            Bound::Bytes {
                max_bytes: usize::MAX,
                held_bytes: 1,
                item_bytes: usize::MAX
            }
        );
        assert_eq!(q.held_bytes(), 1);
        let mut z = AdmissionQueue::new(4, 0);
        z.push(1u8, 0, 0, 0, 0).unwrap();
        assert_eq!(
            z.push(2, 0, 0, 1, 0).unwrap_err().bound,
            Bound::Bytes {
                max_bytes: 0,
                held_bytes: 0,
                item_bytes: 1
            }
        );
        assert_eq!((z.len(), z.held_bytes()), (1, 0));
    }

    #[test]
    fn refusal_messages_name_the_bound() {
        let mut q = AdmissionQueue::new(1, 100);
        q.push(1u8, 0, 0, 70, 0).unwrap();
        assert_eq!(
            q.push(2, 0, 0, 0, 0).unwrap_err().to_string(),
            "admission queue is full (1 entries)"
        );
        let mut q = AdmissionQueue::new(2, 100);
        q.push(1u8, 0, 0, 70, 0).unwrap();
        assert_eq!(
            q.push(2, 0, 0, 31, 0).unwrap_err().to_string(),
            "admission queue is full (70 of 100 bytes held, 31 more do not fit)"
        );
    }

    #[test]
    fn take_expired_takes_only_old_items() {
        let mut q = unbounded(10);
        q.push("a", 0, 1, 0, 1000).unwrap();
        q.push("b", 0, 2, 0, 1500).unwrap();
        q.push("c", 0, 3, 0, 2000).unwrap();
        assert_eq!(q.take_expired(2499, 1000), vec!["a"]);
        assert_eq!(q.take_expired(2500, 1000), vec!["b"]);
        assert_eq!(q.len(), 1);
        assert_eq!(q.take_expired(10, 1000), Vec::<&str>::new());
    }

    #[test]
    fn remove_where_removes_one() {
        let mut q = unbounded(10);
        q.push(7u32, 0, 1, 0, 0).unwrap();
        q.push(8u32, 0, 2, 0, 0).unwrap();
        assert_eq!(q.remove_where(|x| *x == 8), Some(8));
        assert_eq!(q.remove_where(|x| *x == 8), None);
        assert_eq!(q.peek(), Some(&7));
    }

    /// One operation of [`held_bytes_is_the_sum_and_bounded`].
    #[derive(Debug, Clone)]
    enum Op {
        Push { priority: i32, bytes: usize },
        Pop,
        Expire { now_ms: u64, timeout_ms: u64 },
        Remove { nth: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (-2i32..2, 0usize..400).prop_map(|(priority, bytes)| Op::Push { priority, bytes }),
            1 => Just(Op::Pop),
            1 => (0u64..60, 0u64..30).prop_map(|(now_ms, timeout_ms)| Op::Expire { now_ms, timeout_ms }),
            1 => (0usize..8).prop_map(|nth| Op::Remove { nth }),
        ]
    }

    proptest! {
        /// Pops come out sorted by (priority, size) and never exceed capacity.
        #[test]
        fn pops_sorted(items in proptest::collection::vec((-3i32..3, 0u64..100), 0..50), cap in 0usize..40) {
            let mut q = unbounded(cap);
            let mut accepted = 0;
            for (i, (p, s)) in items.iter().enumerate() {
                if q.push((*p, *s, i), *p, *s, 0, 0).is_ok() { accepted += 1; }
                prop_assert!(q.len() <= cap);
            }
            prop_assert_eq!(accepted, items.len().min(cap));
            let out: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
            for w in out.windows(2) {
                prop_assert!((w[0].0, w[0].1, w[0].2) <= (w[1].0, w[1].1, w[1].2));
            }
        }

        /// Against a model (the list of items held, each `(id, bytes)`), over any sequence
        /// of pushes, pops, expiries and removals: a push is accepted exactly when the model
        /// says both bounds allow it, refused with the bound it would pass, and after every
        /// operation the held byte count equals the sum of the held items' bytes and never
        /// exceeds the bound.
        #[test]
        fn held_bytes_is_the_sum_and_bounded(
            ops in proptest::collection::vec(op(), 0..120),
            cap in 0usize..12,
            max_bytes in 0usize..1500,
        ) {
            let mut q = AdmissionQueue::new(cap, max_bytes);
            let mut model: Vec<(usize, usize)> = Vec::new();
            for (id, op) in ops.into_iter().enumerate() {
                let now_ms = id as u64;
                match op {
                    Op::Push { priority, bytes } => {
                        let sum: usize = model.iter().map(|m| m.1).sum();
                        let want = if model.len() >= cap {
                            Err(Bound::Entries { capacity: cap })
                        } else if sum + bytes > max_bytes {
                            Err(Bound::Bytes { max_bytes, held_bytes: sum, item_bytes: bytes })
                        } else {
                            Ok(())
                        };
                        prop_assert_eq!(q.admits(bytes).map(|_| ()), want.as_ref().map_err(|b| *b).map(|_| ()));
                        let got = q.push((id, bytes), priority, 0, bytes, now_ms);
                        prop_assert_eq!(got.as_ref().map_err(|e| e.bound), want.as_ref().map_err(|b| *b));
                        if let Err(e) = got {
                            prop_assert_eq!(e.item, (id, bytes));
                        } else {
                            model.push((id, bytes));
                        }
                    }
                    Op::Pop => {
                        let got = q.pop();
                        prop_assert_eq!(got.is_some(), !model.is_empty());
                        if let Some(item) = got {
                            model.retain(|m| *m != item);
                        }
                    }
                    Op::Expire { now_ms, timeout_ms } => {
                        for item in q.take_expired(now_ms, timeout_ms) {
                            prop_assert!(model.contains(&item));
                            model.retain(|m| *m != item);
                        }
                    }
                    Op::Remove { nth } => {
                        let target = model.get(nth).copied();
                        prop_assert_eq!(q.remove_where(|x| Some(*x) == target), target);
                        model.retain(|m| Some(*m) != target);
                    }
                }
                let sum: usize = model.iter().map(|m| m.1).sum();
                prop_assert_eq!(q.held_bytes(), sum);
                prop_assert!(q.held_bytes() <= max_bytes);
                prop_assert_eq!(q.len(), model.len());
            }
            // Emptied, the count is back to exactly 0.
            while q.pop().is_some() {}
            prop_assert_eq!(q.held_bytes(), 0);
        }
    }
}
