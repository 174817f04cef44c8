//! Nearest-rank percentiles: the one definition every kvroute report uses (replay, the
//! routing benchmark, the simulator's offline replay, the benchmarks), so that numbers from
//! different tools compare.
//!
//! For `n` values sorted ascending and a quantile `q` in `0..=1`, the nearest-rank percentile
//! is the value at 1-based rank `⌈q·n⌉`, with rank 1 for `q = 0`: the smallest value such that
//! at least a fraction `q` of the values are less than or equal to it. It is always one of the
//! observed values, never an interpolation. This is definition 1 of Hyndman & Fan, "Sample
//! Quantiles in Statistical Packages", The American Statistician 50(4), 1996 (the inverse of
//! the empirical distribution function), and numpy's `method="inverted_cdf"`.
//!
//! Examples: for `[1, 2, 3, 4]`, p50 is 2 (rank 2) and p99 is 4 (rank 4); for the values
//! 1..=100, p50 is 50 and p99 is 99.

/// The nearest-rank `q`-quantile of `sorted` (ascending; see the module doc). `q` outside
/// `0..=1` is clamped, and a NaN `q` reads as 0 (the minimum). `None` when `sorted` is empty.
/// The caller sorts; an unsorted slice gives the value at that rank, not the quantile.
pub fn nearest_rank<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    // `as usize` saturates and maps NaN to 0; the clamp then makes the rank 1..=n.
    let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
    sorted.get(rank.clamp(1, n) - 1).copied()
}

/// [`nearest_rank`] over `f64` samples (seconds, ratios), 0 when `sorted` is empty: the
/// convention of kvroute's reports, where an empty series has no latency to show.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    nearest_rank(sorted, q).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)] // test code: fail loudly
    use super::*;
    use proptest::prelude::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn worked_examples() {
        let four = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&four, 0.0), 1.0);
        assert_eq!(percentile(&four, 0.25), 1.0);
        assert_eq!(percentile(&four, 0.26), 2.0);
        assert_eq!(percentile(&four, 0.5), 2.0);
        assert_eq!(percentile(&four, 0.99), 4.0);
        assert_eq!(percentile(&four, 1.0), 4.0);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&hundred, 0.5), 50.0);
        assert_eq!(percentile(&hundred, 0.9), 90.0);
        assert_eq!(percentile(&hundred, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(nearest_rank::<u32>(&[], 0.5), None);
        assert_eq!(nearest_rank(&[7u128], 0.99), Some(7));
        // Out-of-range and NaN quantiles.
        assert_eq!(percentile(&four, -1.0), 1.0);
        assert_eq!(percentile(&four, 2.0), 4.0);
        assert_eq!(percentile(&four, f64::NAN), 1.0);
    }

    proptest! {
        /// The defining property: the result is an element, at least ⌈q·n⌉ elements are
        /// ≤ it, and fewer than ⌈q·n⌉ are strictly below it.
        #[test]
        fn is_the_smallest_value_covering_q(
            mut v in proptest::collection::vec(-1000i32..1000, 1..200),
            q in 0.0f64..=1.0,
        ) {
            v.sort_unstable();
            let p = nearest_rank(&v, q).unwrap();
            let n = v.len();
            let need = ((q * n as f64).ceil() as usize).max(1);
            prop_assert!(v.contains(&p));
            prop_assert!(v.iter().filter(|x| **x <= p).count() >= need);
            prop_assert!(v.iter().filter(|x| **x < p).count() < need);
        }

        /// Monotone in q.
        #[test]
        fn monotone_in_q(
            mut v in proptest::collection::vec(-1e6f64..1e6, 1..100),
            a in 0.0f64..=1.0,
            b in 0.0f64..=1.0,
        ) {
            v.sort_by(f64::total_cmp);
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            prop_assert!(percentile(&v, lo) <= percentile(&v, hi));
        }
    }
}
