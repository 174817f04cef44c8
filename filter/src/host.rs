//! The host seam: everything the glue needs from proxy-wasm, as a trait. [`crate::wasm`]
//! implements it over the proxy-wasm SDK; [`mock::MockHost`] implements it in memory so the
//! glue is unit-tested natively. Host status codes become [`HostError`] here.

pub use crate::headers::HeaderMap;

/// A host call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// Compare-and-swap on shared data lost a race.
    #[error("shared data CAS mismatch")]
    CasMismatch,
    /// Anything else (status rendered).
    #[error("host call failed: {0}")]
    Other(String),
}

/// Metric kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Monotonic counter.
    Counter,
    /// Gauge.
    Gauge,
    /// Histogram.
    Histogram,
}

/// Log levels used by the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Debug.
    Debug,
    /// Info.
    Info,
    /// Warn.
    Warn,
    /// Error.
    Error,
}

/// Whether `period_ms` has passed at `now_ms` since `last_ms` (both [`Host::now_ms`], Unix
/// ms), or the clock went back past `last_ms`. The host's clock is the wall clock, which an
/// NTP step can move back: with a plain difference, work done "once per period" would then
/// stop for as long as the step (a worker's ticks in the native build, its journal sync,
/// its reads of the other workers' tables); here it runs at once and its period starts
/// again from the new time.
pub fn period_passed(now_ms: u64, last_ms: u64, period_ms: u64) -> bool {
    now_ms < last_ms || now_ms - last_ms >= period_ms
}

/// Host calls used by the filter glue.
pub trait Host {
    /// Now, Unix milliseconds (proxy-wasm `get_current_time`).
    fn now_ms(&self) -> u64;
    /// Now, Unix microseconds (for durations such as decision time).
    fn now_us(&self) -> u64 {
        self.now_ms().saturating_mul(1000)
    }
    /// A request header (`:path`, `:method` included); `None` when absent or when its
    /// value is not UTF-8 (HTTP allows such bytes; they are never read as text).
    fn request_header(&self, name: &str) -> Option<String>;
    /// Every request header in one host call (proxy-wasm `proxy_get_header_map_pairs`,
    /// for what would take one call per header), read in place ([`HeaderMap`]).
    fn request_headers(&self) -> HeaderMap;
    /// Set (`Some`) or remove (`None`) a request header.
    fn set_request_header(&self, name: &str, value: Option<&str>);
    /// Set a response header.
    fn set_response_header(&self, name: &str, value: &str);
    /// A response header (`:status` included); `None` when absent or not UTF-8.
    fn response_header(&self, name: &str) -> Option<String>;
    /// Call `f` with bytes `0..size` of the buffered request body (`None` when the host
    /// has none) and return what it returns. The bytes live only for the call: the native
    /// build reads them into one buffer per worker thread, reused by every request whose
    /// body fits it (`KEPT_BODY_BYTES` in `dynmod/src/glue.rs`: an allocation and a free
    /// fewer per request); the Wasm build's host hands over a new copy.
    fn with_request_body<R>(&self, size: usize, f: impl FnOnce(Option<&[u8]>) -> R) -> R;
    /// Bytes `0..size` of the current response body chunk.
    fn response_body(&self, size: usize) -> Option<Vec<u8>>;
    /// Answer locally; the request goes nowhere upstream.
    fn send_local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// Read shared data: value and CAS token.
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError>;
    /// Write shared data; with `cas`, fails with [`HostError::CasMismatch`] if it changed.
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError>;
    /// Enqueue `data` on the shared queue `name` of VM `vm_id`.
    fn enqueue(&self, vm_id: &str, name: &str, data: &[u8]) -> Result<(), HostError>;
    /// Add to a metric (counter/gauge) by name.
    fn metric_add(&self, kind: MetricKind, name: &'static str, delta: i64);
    /// Record a histogram value or set a gauge.
    fn metric_record(&self, kind: MetricKind, name: &'static str, value: u64);
    /// Set a gauge whose name is built at run time (one per endpoint: the names are
    /// bounded by the endpoints ever seen, and defined once each).
    fn gauge_set_named(&self, name: &str, value: u64);
    /// Drop this VM's handle of a run-time-named gauge (its endpoint left the snapshot), so
    /// the handles stay bounded by the endpoints in force. Envoy keeps the stat itself.
    fn forget_named_gauge(&self, name: &str);
    /// Log one line.
    fn log(&self, level: Level, msg: &str);
    /// Make HTTP context `context_id` the target of the next stream calls (from a root
    /// context's tick). False when that context is gone.
    fn set_effective_context(&self, context_id: u32) -> bool;
    /// Resume a paused request (of the effective context).
    fn resume_request(&self);
    /// An Envoy attribute as a string, e.g. `["response", "code_details"]`
    /// (<https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/advanced/attributes>);
    /// `None` when absent or not readable here.
    fn property(&self, _path: &[&str]) -> Option<String> {
        None
    }

    /// Set a per-request property. Envoy stores it as filter state named `wasm.<path>`,
    /// which access logs read with `%FILTER_STATE(wasm.<path>:PLAIN)%`.
    fn set_property(&self, _path: &[&str], _value: &[u8]) {}
}

#[cfg(any(test, feature = "testing"))]
pub mod mock {
    //! In-memory [`Host`] for native tests, with builder methods.
    use super::*;
    use std::cell::RefCell;
    use std::collections::BTreeMap;
    use std::rc::Rc;

    /// Process-wide state shared by several mock hosts (like Envoy's shared data across
    /// worker VMs).
    #[derive(Debug, Default)]
    pub struct SharedState {
        /// key → (value, cas)
        pub data: BTreeMap<String, (Vec<u8>, u32)>,
        /// queue name → items
        pub queues: BTreeMap<String, Vec<Vec<u8>>>,
        /// Forced CAS failures remaining (to test retries).
        pub fail_cas: u32,
        /// Forced failures of the next `shared_set` calls, whatever their CAS (a host
        /// error other than a CAS mismatch).
        pub fail_sets: u32,
    }

    /// A local reply sent by the filter.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct LocalReply {
        /// Status.
        pub status: u32,
        /// Headers.
        pub headers: Vec<(String, String)>,
        /// Body.
        pub body: Vec<u8>,
    }

    /// One stream's host view plus shared state.
    #[derive(Debug, Default, Clone)]
    pub struct MockHost {
        /// Shared state (clone the Rc to share between hosts).
        pub shared: Rc<RefCell<SharedState>>,
        /// Clock, Unix ms.
        pub now: Rc<RefCell<u64>>,
        /// Microseconds [`Host::now_us`] adds to the clock after each call (0 by default:
        /// a still clock), and what it has added so far: a clock that moves while the code
        /// under test runs.
        pub us_step: Rc<RefCell<(u64, u64)>>,
        /// Request headers.
        pub req_headers: Rc<RefCell<BTreeMap<String, String>>>,
        /// Request headers with raw byte values ([`MockHost::with_raw_header`]).
        pub raw_headers: Rc<RefCell<Vec<RawHeader>>>,
        /// Response headers.
        pub resp_headers: Rc<RefCell<BTreeMap<String, String>>>,
        /// Request body.
        pub req_body: Rc<RefCell<Vec<u8>>>,
        /// Current response chunk.
        pub resp_chunk: Rc<RefCell<Vec<u8>>>,
        /// Local replies sent.
        pub replies: Rc<RefCell<Vec<LocalReply>>>,
        /// Metric values by name.
        pub metrics: Rc<RefCell<BTreeMap<&'static str, i64>>>,
        /// Gauges with run-time names ([`Host::gauge_set_named`]).
        pub named_gauges: Rc<RefCell<BTreeMap<String, u64>>>,
        /// Names passed to [`Host::forget_named_gauge`], in order.
        pub forgotten_gauges: Rc<RefCell<Vec<String>>>,
        /// Log lines.
        pub logs: Rc<RefCell<Vec<String>>>,
        /// (effective context, event) log: "resume" / "reply:<status>".
        pub ctx_events: Rc<RefCell<Vec<(u32, String)>>>,
        /// Current effective context.
        pub effective: Rc<RefCell<u32>>,
        /// Contexts Envoy no longer knows: [`Host::set_effective_context`] to one fails.
        pub gone: Rc<RefCell<std::collections::BTreeSet<u32>>>,
        /// Envoy attributes by dotted path (e.g. `response.code_details`).
        pub properties: Rc<RefCell<BTreeMap<String, String>>>,
        /// Host calls made through this host, by [`Host`] method name (not shared with
        /// siblings): what a request costs in crossings of the Wasm boundary.
        pub calls: Rc<RefCell<BTreeMap<&'static str, u32>>>,
    }

    /// A request header whose value is raw bytes: name, value.
    pub type RawHeader = (String, Vec<u8>);

    /// A header map serialized as the batch host call returns it: `m`, then `raw`.
    fn serialized(m: &BTreeMap<String, String>, raw: &[RawHeader]) -> HeaderMap {
        HeaderMap::from_pairs(
            m.iter()
                .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
                .chain(raw.iter().map(|(k, v)| (k.as_bytes(), v.as_slice()))),
        )
    }

    impl MockHost {
        /// A host at time `now_ms` with fresh shared state.
        pub fn new(now_ms: u64) -> Self {
            let h = Self::default();
            *h.now.borrow_mut() = now_ms;
            h
        }

        /// A host for another stream sharing this one's shared state and clock.
        pub fn sibling(&self) -> Self {
            Self {
                shared: self.shared.clone(),
                now: self.now.clone(),
                us_step: self.us_step.clone(),
                metrics: self.metrics.clone(),
                named_gauges: self.named_gauges.clone(),
                logs: self.logs.clone(),
                ..Self::default()
            }
        }

        /// Builder: set a request header.
        pub fn with_header(self, k: &str, v: &str) -> Self {
            self.req_headers.borrow_mut().insert(k.into(), v.into());
            self
        }

        /// Builder: add a request header whose value is raw bytes (not UTF-8, say), after
        /// the others; only [`Host::request_headers`] returns it.
        pub fn with_raw_header(self, k: &str, v: &[u8]) -> Self {
            self.raw_headers.borrow_mut().push((k.into(), v.to_vec()));
            self
        }

        /// Builder: set an Envoy attribute (dotted path, e.g. `response.code_details`).
        pub fn with_property(self, path: &str, v: &str) -> Self {
            self.properties.borrow_mut().insert(path.into(), v.into());
            self
        }

        /// Builder: set the request body.
        pub fn with_body(self, b: &[u8]) -> Self {
            *self.req_body.borrow_mut() = b.to_vec();
            self
        }

        /// Metric value by name (0 when never touched).
        pub fn metric(&self, name: &str) -> i64 {
            self.metrics.borrow().get(name).copied().unwrap_or(0)
        }

        /// A request header as set now.
        pub fn header(&self, k: &str) -> Option<String> {
            self.req_headers.borrow().get(k).cloned()
        }

        /// Local replies so far.
        pub fn replies(&self) -> Vec<LocalReply> {
            self.replies.borrow().clone()
        }

        /// Host calls since the last take (or since creation), by method name in name
        /// order; the count starts again from zero.
        pub fn take_calls(&self) -> Vec<(&'static str, u32)> {
            std::mem::take(&mut *self.calls.borrow_mut())
                .into_iter()
                .collect()
        }

        fn count(&self, method: &'static str) {
            *self.calls.borrow_mut().entry(method).or_default() += 1;
        }
    }

    impl Host for MockHost {
        fn now_ms(&self) -> u64 {
            self.count("now_ms");
            *self.now.borrow()
        }
        fn now_us(&self) -> u64 {
            self.count("now_us");
            let mut step = self.us_step.borrow_mut();
            let t = self
                .now
                .borrow()
                .saturating_mul(1000)
                .saturating_add(step.1);
            step.1 = step.1.saturating_add(step.0);
            t
        }
        fn request_header(&self, name: &str) -> Option<String> {
            self.count("request_header");
            self.req_headers.borrow().get(name).cloned()
        }
        fn request_headers(&self) -> HeaderMap {
            self.count("request_headers");
            serialized(&self.req_headers.borrow(), &self.raw_headers.borrow())
        }
        fn set_request_header(&self, name: &str, value: Option<&str>) {
            self.count("set_request_header");
            self.raw_headers
                .borrow_mut()
                .retain(|(k, _)| !k.eq_ignore_ascii_case(name));
            let mut h = self.req_headers.borrow_mut();
            match value {
                Some(v) => h.insert(name.into(), v.into()),
                None => h.remove(name),
            };
        }
        fn set_response_header(&self, name: &str, value: &str) {
            self.count("set_response_header");
            self.resp_headers
                .borrow_mut()
                .insert(name.into(), value.into());
        }
        fn response_header(&self, name: &str) -> Option<String> {
            self.count("response_header");
            self.resp_headers.borrow().get(name).cloned()
        }
        fn with_request_body<R>(&self, size: usize, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
            self.count("request_body");
            // A copy, so that `f` may reach the host's body again (as a real host allows).
            let b = self.req_body.borrow().clone();
            f(b.get(..size.min(b.len())))
        }
        fn response_body(&self, size: usize) -> Option<Vec<u8>> {
            self.count("response_body");
            let b = self.resp_chunk.borrow();
            b.get(..size.min(b.len())).map(|s| s.to_vec())
        }
        fn property(&self, path: &[&str]) -> Option<String> {
            self.count("property");
            self.properties.borrow().get(&path.join(".")).cloned()
        }
        fn set_property(&self, path: &[&str], value: &[u8]) {
            self.count("set_property");
            self.properties
                .borrow_mut()
                .insert(path.join("."), String::from_utf8_lossy(value).into_owned());
        }
        fn send_local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
            self.count("send_local_reply");
            let ctx = *self.effective.borrow();
            self.ctx_events
                .borrow_mut()
                .push((ctx, format!("reply:{status}")));
            self.replies.borrow_mut().push(LocalReply {
                status,
                headers: headers
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                body: body.to_vec(),
            });
        }
        fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
            self.count("shared_get");
            Ok(match self.shared.borrow().data.get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            })
        }
        fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
            self.count("shared_set");
            let mut s = self.shared.borrow_mut();
            if s.fail_sets > 0 {
                s.fail_sets -= 1;
                return Err(HostError::Other("injected shared_set failure".into()));
            }
            if cas.is_some() && s.fail_cas > 0 {
                s.fail_cas -= 1;
                return Err(HostError::CasMismatch);
            }
            let cur = s.data.get(key).map(|(_, c)| *c).unwrap_or(0);
            if let Some(c) = cas {
                if c != cur && !(cur == 0 && c == 0) {
                    return Err(HostError::CasMismatch);
                }
            }
            s.data.insert(key.into(), (value.to_vec(), cur + 1));
            Ok(())
        }
        fn enqueue(&self, _vm_id: &str, name: &str, data: &[u8]) -> Result<(), HostError> {
            self.count("enqueue");
            self.shared
                .borrow_mut()
                .queues
                .entry(name.into())
                .or_default()
                .push(data.to_vec());
            Ok(())
        }
        fn metric_add(&self, _kind: MetricKind, name: &'static str, delta: i64) {
            self.count("metric_add");
            *self.metrics.borrow_mut().entry(name).or_default() += delta;
        }
        fn metric_record(&self, kind: MetricKind, name: &'static str, value: u64) {
            self.count("metric_record");
            let v = i64::try_from(value).unwrap_or(i64::MAX);
            let mut m = self.metrics.borrow_mut();
            match kind {
                MetricKind::Histogram => *m.entry(name).or_default() += 1,
                _ => {
                    m.insert(name, v);
                }
            }
        }
        fn gauge_set_named(&self, name: &str, value: u64) {
            self.count("gauge_set_named");
            self.named_gauges
                .borrow_mut()
                .insert(name.to_owned(), value);
        }
        fn forget_named_gauge(&self, name: &str) {
            self.count("forget_named_gauge");
            self.forgotten_gauges.borrow_mut().push(name.to_owned());
        }
        fn log(&self, _level: Level, msg: &str) {
            self.count("log");
            self.logs.borrow_mut().push(msg.into());
        }
        fn set_effective_context(&self, context_id: u32) -> bool {
            self.count("set_effective_context");
            if self.gone.borrow().contains(&context_id) {
                return false;
            }
            *self.effective.borrow_mut() = context_id;
            true
        }
        fn resume_request(&self) {
            self.count("resume_request");
            let ctx = *self.effective.borrow();
            self.ctx_events.borrow_mut().push((ctx, "resume".into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::period_passed;

    #[test]
    fn a_period_passes_after_its_length_or_a_clock_step_back() {
        assert!(!period_passed(1_000, 1_000, 50));
        assert!(!period_passed(1_049, 1_000, 50));
        assert!(period_passed(1_050, 1_000, 50));
        // Never done (0) and a period of 0.
        assert!(period_passed(1_000, 0, 50));
        assert!(period_passed(1_000, 1_000, 0));
        // The clock stepped back by a minute: passed at once, not a minute later.
        assert!(period_passed(1_000, 61_000, 50));
    }
}
