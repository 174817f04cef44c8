//! Restart detection for one endpoint.
//!
//! A model server that restarts in place keeps its address but loses its prefix cache, so
//! the filter must forget what it believed was cached there. The filter does that when an
//! endpoint's `process_start_ms` changes; this module makes sure it changes on every restart:
//! - the server exports a process start time (`process_start_time_seconds`, vLLM's
//!   `_created` gauges) and it is newer than last seen → restart; or
//! - a counter that only grows (prompt tokens, request count) went down → restart. When the
//!   server exports no start time, the first successful scrape's time stands in for it and
//!   each detected restart replaces it with the detection time; with one,
//!   `max(reported, detection time)` is carried so the value still moves forward.
//!
//! The stand-in is set from the first scrape (not left `None`) because the filter
//! (`filter/src/router.rs`) clears prefix state only when a *known* start time changes. The
//! cost: after a control-plane restart those endpoints get a new stand-in, so the filter
//! forgets their prefix state once (conservative: it never routes on a stale belief).

use crate::adapters::ServerStats;

/// Per-endpoint restart state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RestartTracker {
    last_start_ms: Option<u64>,
    last_total: Option<f64>,
    epoch_ms: Option<u64>,
    /// Restarts detected so far.
    pub restarts: u64,
}

impl RestartTracker {
    /// Feed one successful scrape taken at `now_ms` (Unix ms); true when it shows a restart.
    pub fn observe(&mut self, stats: &ServerStats, now_ms: u64) -> bool {
        let by_start = matches!(
            (self.last_start_ms, stats.process_start_ms),
            (Some(old), Some(new)) if new > old
        );
        let by_counter = matches!(
            (self.last_total, stats.monotonic_total),
            (Some(old), Some(new)) if new < old
        );
        let first =
            self.last_start_ms.is_none() && self.last_total.is_none() && self.epoch_ms.is_none();
        if (by_counter && !by_start) || (first && stats.process_start_ms.is_none()) {
            self.epoch_ms = Some(now_ms);
        }
        if let Some(s) = stats.process_start_ms {
            self.last_start_ms = Some(s);
        }
        if stats.monotonic_total.is_some() {
            self.last_total = stats.monotonic_total;
        }
        let restarted = by_start || by_counter;
        if restarted {
            self.restarts += 1;
        }
        restarted
    }

    /// The process start to publish, Unix ms; `None` before the first observation.
    pub fn process_start_ms(&self) -> Option<u64> {
        match (self.last_start_ms, self.epoch_ms) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0).max(b.unwrap_or(0))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(start: Option<u64>, total: Option<f64>) -> ServerStats {
        ServerStats {
            process_start_ms: start,
            monotonic_total: total,
            ..ServerStats::default()
        }
    }

    #[test]
    fn newer_start_time_is_a_restart() {
        let mut t = RestartTracker::default();
        assert!(!t.observe(&stats(Some(1000), Some(5.0)), 2000));
        assert!(!t.observe(&stats(Some(1000), Some(9.0)), 2200));
        assert_eq!(t.process_start_ms(), Some(1000));
        assert!(t.observe(&stats(Some(3000), Some(50.0)), 3500));
        assert_eq!(t.process_start_ms(), Some(3000));
        assert_eq!(t.restarts, 1);
    }

    #[test]
    fn counter_decrease_without_start_time_sets_epoch() {
        let mut t = RestartTracker::default();
        assert_eq!(t.process_start_ms(), None);
        assert!(!t.observe(&stats(None, Some(100.0)), 1000));
        assert_eq!(t.process_start_ms(), Some(1000));
        assert!(t.observe(&stats(None, Some(3.0)), 7000));
        assert_eq!(t.process_start_ms(), Some(7000));
        assert!(!t.observe(&stats(None, Some(4.0)), 7200));
        assert_eq!(t.process_start_ms(), Some(7000));
        assert!(t.observe(&stats(None, Some(0.0)), 9000));
        assert_eq!(t.process_start_ms(), Some(9000));
        assert_eq!(t.restarts, 2);
    }

    #[test]
    fn unknown_counters_never_signal() {
        let mut t = RestartTracker::default();
        assert!(!t.observe(&stats(None, None), 1));
        assert!(!t.observe(&stats(None, None), 2));
        assert_eq!(t.process_start_ms(), Some(1));
        assert_eq!(t.restarts, 0);
    }
}
