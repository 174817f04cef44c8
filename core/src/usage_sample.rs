//! Which responses the host reads for their `usage`.
//!
//! A response's `usage` (prompt and completion tokens) feeds two learners: the estimator's
//! per-model calibration ([`crate::router::Router::observe_usage`]) and the learned output
//! lengths ([`crate::router::Router::observe_output`]). Reading it is the dearest part of a
//! response for the filter: every body chunk must be copied into the VM, a host call that
//! returns data, because the usage event comes last and nothing marks the chunk that holds
//! it. With OpenAI's streaming format that is one read per token event: ~4 k instructions
//! per chunk inside Envoy's V8 beyond what plain Envoy spends on it, against ~0.7 k for a
//! chunk not read (docs/overhead.md, the ninth change). The learners need tens
//! of observations per second, not every response.
//!
//! A read may yield nothing: an error reply, or a stream whose request did not ask for
//! `stream_options.include_usage` (OpenAI and vLLM send no usage then). The bucket counts
//! it all the same.
//!
//! **Rule** ([`UsageSampler::sample`]): a token bucket per model, as Envoy's local rate
//! limit. A read takes one token; tokens come back one per `interval_ms`, up to
//! [`BURST_READS`], and a new model starts with a full bucket. So a model whose responses
//! arrive at under `1000 / interval_ms` per second on average (200 by default), with bursts
//! of up to [`BURST_READS`], is read in full, exactly as without sampling; a busier one is
//! read at that rate per router (per Envoy worker; with learner sharing the workers' samples
//! add up, [`crate::observation`]). The first [`BURST_READS`] responses of a model are all
//! read: the output-length histogram answers after 20 observations
//! ([`crate::output_len::MIN_OBSERVATIONS`]) and calibration moves by
//! [`crate::router::CALIBRATION_ALPHA`] per observation. The choice is made when the
//! response begins, before its length is known, so the sample is not biased by output
//! length; the learners' windows (~1 000 observations for output lengths) then span more
//! time, not fewer observations.
//!
//! What needs no `usage` is done for every response by the host: the end of prefill at
//! the first token of an event stream with its TTFT sample (the first chunk of a request
//! with `stream: true` is read to tell an event stream from an error reply, and the next
//! ones while it shows no token: [`crate::usage::FirstTokenScanner`]), and the release of
//! the reservation at the end.
//!
//! Memory: one entry per model, at most [`MAX_MODELS`]; a new model past that replaces
//! the one whose last response is oldest.

/// Bucket size: reads a model may take at once (and its first reads, all taken).
pub const BURST_READS: u64 = 100;
/// Default interval at which a model's bucket gets a read back, milliseconds (200 reads per
/// second per model per router once the bucket is empty). Chosen by the routing benchmark:
/// at 5 ms every Mooncake and ShareGPT cell is unchanged and the Azure cells (67–384
/// requests per second) move by at most 2.4 % over three seeds; at 20 ms Azure cells moved
/// by up to 11 % (docs/overhead.md, the ninth change).
pub const DEFAULT_INTERVAL_MS: u64 = 5;
/// Models remembered at most (as [`crate::output_len::MAX_KEYS`]).
pub const MAX_MODELS: usize = 64;

#[derive(Debug, Clone)]
struct Bucket {
    model: String,
    /// The bucket's content in milliseconds of refill: `interval_ms` per read, at most
    /// [`BURST_READS`] × `interval_ms`.
    credit_ms: u64,
    /// Time of the model's last response, ms (the caller's clock; refill counts from
    /// here).
    last_ms: u64,
}

/// Per-model choice of the responses whose `usage` is read (see the module doc).
#[derive(Debug, Clone, Default)]
pub struct UsageSampler {
    interval_ms: u64,
    buckets: Vec<Bucket>,
}

impl UsageSampler {
    /// A sampler refilling each model's bucket by one read every `interval_ms`
    /// milliseconds; 0 reads every response.
    pub fn new(interval_ms: u64) -> Self {
        Self {
            interval_ms,
            buckets: Vec::new(),
        }
    }

    /// Interval at which a model's bucket gets a read back, milliseconds (0: all are read).
    pub fn interval_ms(&self) -> u64 {
        self.interval_ms
    }

    /// Whether to read the `usage` of a response to a request for `model` (`""` when the
    /// request named none) that begins at `now_ms` (the caller's clock, milliseconds; a
    /// step backwards refills nothing, and refilling resumes from the new time, so a wall
    /// clock stepped back by NTP does not stop reading). A `true` takes a read from the
    /// model's bucket.
    pub fn sample(&mut self, model: &str, now_ms: u64) -> bool {
        let interval = self.interval_ms;
        if interval == 0 {
            return true;
        }
        let full = BURST_READS.saturating_mul(interval);
        if let Some(b) = self.buckets.iter_mut().find(|b| b.model == model) {
            let refill = now_ms.saturating_sub(b.last_ms);
            b.credit_ms = b.credit_ms.saturating_add(refill).min(full);
            b.last_ms = now_ms;
            let read = b.credit_ms >= interval;
            if read {
                b.credit_ms -= interval;
            }
            return read;
        }
        if self.buckets.len() >= MAX_MODELS {
            let oldest = (self.buckets.iter().enumerate())
                .min_by_key(|(_, b)| b.last_ms)
                .map(|(i, _)| i);
            if let Some(i) = oldest {
                self.buckets.swap_remove(i);
            }
        }
        self.buckets.push(Bucket {
            model: model.to_owned(),
            credit_ms: full.saturating_sub(interval),
            last_ms: now_ms,
        });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which of `times` (ms) the sampler reads for model `m`.
    fn reads(s: &mut UsageSampler, m: &str, times: impl IntoIterator<Item = u64>) -> Vec<u64> {
        times.into_iter().filter(|&t| s.sample(m, t)).collect()
    }

    #[test]
    fn interval_zero_reads_everything() {
        let mut s = UsageSampler::new(0);
        assert_eq!(reads(&mut s, "m", [5, 5, 5, 6]), [5, 5, 5, 6]);
    }

    #[test]
    fn a_burst_empties_the_bucket_then_one_read_per_interval() {
        let mut s = UsageSampler::new(20);
        // 100 responses within one millisecond: all read (a full bucket), the 101st not.
        assert_eq!(
            reads(&mut s, "m", std::iter::repeat_n(1_000, 101)).len(),
            100
        );
        // One every 5 ms from 1 005: a read comes back every 20 ms.
        assert_eq!(
            reads(&mut s, "m", (1..=16).map(|i| 1_000 + 5 * i)),
            [1_020, 1_040, 1_060, 1_080]
        );
        // A pause refills the bucket: 3 s later (150 intervals) it holds 100 reads again.
        assert_eq!(
            reads(&mut s, "m", std::iter::repeat_n(4_080, 101)).len(),
            100
        );
    }

    #[test]
    fn a_model_under_the_rate_is_read_in_full() {
        let mut s = UsageSampler::new(20);
        // 40 responses per second for a minute, in bursts of 10 at once: every one read.
        let times: Vec<u64> = (0..240u64)
            .flat_map(|burst| std::iter::repeat_n(burst * 250, 10))
            .collect();
        assert_eq!(reads(&mut s, "m", times.iter().copied()).len(), times.len());
        // 100 per second for 10 s: the bucket's 100 plus one per 20 ms over the 9.99 s
        // (499).
        let mut s = UsageSampler::new(20);
        let n = reads(&mut s, "m", (0..1_000u64).map(|i| i * 10)).len();
        assert_eq!(n, 599);
    }

    #[test]
    fn models_are_sampled_apart() {
        let mut s = UsageSampler::new(20);
        for _ in 0..BURST_READS {
            assert!(s.sample("busy", 0));
        }
        assert!(!s.sample("busy", 1));
        // A model with no reads yet is read however busy another is.
        assert_eq!(reads(&mut s, "quiet", [1, 2, 3]), [1, 2, 3]);
        assert!(!s.sample("busy", 19));
        assert!(s.sample("busy", 20));
    }

    #[test]
    fn a_clock_stepping_back_refills_nothing_then_refills_from_there() {
        let mut s = UsageSampler::new(10);
        for _ in 0..BURST_READS {
            s.sample("m", 4_000_000);
        }
        // Stepped back an hour: the step refills nothing, then one read per 10 ms again
        // (not an hour without reads).
        assert_eq!(
            reads(&mut s, "m", [400_000, 400_005, 400_010, 400_015, 400_020]),
            [400_010, 400_020]
        );
    }

    #[test]
    fn models_past_the_bound_replace_the_one_seen_least_recently() {
        let mut s = UsageSampler::new(10);
        for i in 0..MAX_MODELS as u64 {
            assert!(s.sample(&format!("m{i}"), 100 + i));
        }
        // m0 (last seen at 100) goes; the others keep their buckets.
        assert!(s.sample("new", 500));
        assert_eq!(s.buckets.len(), MAX_MODELS);
        assert!(!s.buckets.iter().any(|b| b.model == "m0"));
        assert!(s
            .buckets
            .iter()
            .any(|b| b.model == "m1" && b.credit_ms == 990));
        // m0 comes back as a new model, with a full bucket.
        assert!(s.sample("m0", 501));
    }
}
