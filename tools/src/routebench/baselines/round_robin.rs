//! `round_robin`: request *i* goes to replica *i mod N* — the load balancer every other
//! router is compared against (Envoy's `ROUND_ROBIN` lb policy without weights; Dynamo's
//! `--router-mode round-robin`). Looks at no state, so N replicas receive exactly
//! ⌈k/N⌉ or ⌊k/N⌋ of k requests.

/// Stateful cursor.
#[derive(Debug, Clone, Default)]
pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    /// A cursor starting at replica 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next replica out of `n`; `None` when `n == 0`.
    pub fn pick(&mut self, n: usize) -> Option<usize> {
        if n == 0 {
            return None;
        }
        let k = self.next % n;
        self.next = self.next.wrapping_add(1);
        Some(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_in_order() {
        let mut r = RoundRobin::new();
        let picks: Vec<_> = (0..7).filter_map(|_| r.pick(3)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2, 0]);
        assert_eq!(r.pick(0), None);
    }
}
