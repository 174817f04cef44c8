//! One HTTP stream through the filter: the request/response state machine over [`Host`].
//!
//! Request side (role `route`):
//! 1. headers: strip client-supplied routing headers; if there is no body
//!    (`end_of_stream`), an `Upgrade` header, a `Content-Encoding`, or a `Content-Length`
//!    over `max_body_bytes`, decide now without the body; else pause (Envoy buffers the
//!    body; needs `allow_on_headers_stop_iteration: true`).
//! 2. body: keep pausing until end of stream (if the buffered size passes `max_body_bytes`,
//!    decide by load alone and continue), then read the body and decide.
//!
//! Response side: never buffered. The time from decision to response headers is recorded
//! as TTFB; each body chunk is copied into a bounded `usage` scanner (SSE) or a bounded
//! tail (JSON). At response end the reservation is released and the usage calibrates the
//! estimator. `on_done` releases too, so client resets and upstream errors release; a
//! reservation is released exactly once ([`Option::take`]).
//!
//! Role `ingest`: see [`crate::ingest`]; every request is answered locally.

use crate::config::{Role};
use crate::host::{Host, Level, MetricKind};
use crate::ingest;
use crate::names::{metric, DECISION_HEADER};
use crate::router::{Decision, Held, Parked, RequestFacts, Worker};
use kvroute_core::usage::{self, SseUsageScanner};
use std::cell::RefCell;
use std::rc::Rc;

/// What to tell Envoy after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Continue the filter chain.
    Continue,
    /// Stop iteration (buffer / wait / local reply sent).
    Pause,
}

#[derive(Debug, Default)]
enum Resp {
    #[default]
    None,
    Sse(SseUsageScanner),
    Json {
        tail: Vec<u8>,
        total: usize,
    },
}

/// Per-stream state.
#[derive(Debug)]
pub struct Stream {
    worker: Rc<RefCell<Worker>>,
    context_id: u32,
    path: String,
    decided: bool,
    replied: bool,
    queued: bool,
    held: Option<Held>,
    facts: RequestFacts,
    decided_at_ms: u64,
    reason: String,
    resp: Resp,
}

fn json_error(error: &str) -> String {
    serde_json::json!({ "error": error }).to_string()
}

impl Stream {
    /// A stream of HTTP context `context_id` on `worker`.
    pub fn new(worker: Rc<RefCell<Worker>>, context_id: u32) -> Self {
        Self {
            worker,
            context_id,
            path: String::new(),
            decided: false,
            replied: false,
            queued: false,
            held: None,
            facts: RequestFacts::default(),
            decided_at_ms: 0,
            reason: String::new(),
            resp: Resp::None,
        }
    }

    fn role(&self) -> Role {
        self.worker.borrow().config.role
    }

    fn reply<H: Host>(&mut self, host: &H, status: u32, body: &str, extra: &[(&str, &str)]) {
        if self.replied {
            return;
        }
        self.replied = true;
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(extra.len() + 1);
        if !body.is_empty() {
            headers.push(("content-type", "application/json"));
        }
        headers.extend_from_slice(extra);
        host.send_local_reply(status, &headers, body.as_bytes());
    }

    /// Request headers arrived.
    pub fn on_request_headers<H: Host>(&mut self, host: &H, end_of_stream: bool) -> Flow {
        self.path = host.request_header(":path").unwrap_or_default();
        if self.role() == Role::Ingest {
            let reply = {
                let w = self.worker.borrow();
                ingest::check_headers(
                    &w.config,
                    host.request_header(":method").as_deref(),
                    Some(&self.path),
                    host.request_header("authorization").as_deref(),
                    host.request_header("content-length").as_deref(),
                )
            };
            if let Some(r) = reply {
                host.metric_add(MetricKind::Counter, metric::INGEST_REJECTED, 1);
                self.reply(host, r.status, &r.body, &[]);
                return Flow::Pause;
            }
            if end_of_stream {
                return self.finish_ingest(host, &[]);
            }
            return Flow::Pause;
        }
        let (ch, eh, max, encoded_ok) = {
            let w = self.worker.borrow();
            (
                w.config.cluster_header.clone(),
                w.config.endpoint_header.clone(),
                w.config.max_body_bytes,
                false,
            )
        };
        // A client must not choose its own backend.
        host.set_request_header(&ch, None);
        host.set_request_header(&eh, None);
        host.set_request_header(DECISION_HEADER, None);
        let upgrade = host.request_header("upgrade").is_some();
        let encoded = host
            .request_header("content-encoding")
            .is_some_and(|e| !e.eq_ignore_ascii_case("identity"));
        let too_big = host
            .request_header("content-length")
            .and_then(|l| l.trim().parse::<u64>().ok())
            .is_some_and(|l| l > max as u64);
        if end_of_stream || upgrade || (encoded && !encoded_ok) || too_big {
            return self.decide(host, None);
        }
        Flow::Pause
    }

    /// A request body chunk arrived; `buffered` is the total buffered size.
    pub fn on_request_body<H: Host>(&mut self, host: &H, buffered: usize, end_of_stream: bool) -> Flow {
        if self.replied {
            return Flow::Pause;
        }
        if self.role() == Role::Ingest {
            let max = self.worker.borrow().config.ingest_max_bytes;
            if buffered > max {
                let r = ingest::too_large(&self.worker.borrow().config);
                host.metric_add(MetricKind::Counter, metric::INGEST_REJECTED, 1);
                self.reply(host, r.status, &r.body, &[]);
                return Flow::Pause;
            }
            if !end_of_stream {
                return Flow::Pause;
            }
            let body = host.request_body(buffered).unwrap_or_default();
            return self.finish_ingest(host, &body);
        }
        if self.decided {
            return Flow::Continue;
        }
        let max = self.worker.borrow().config.max_body_bytes;
        if buffered > max {
            return self.decide(host, None);
        }
        if !end_of_stream {
            return Flow::Pause;
        }
        let body = host.request_body(buffered).unwrap_or_default();
        self.decide(host, Some(&body))
    }

    fn finish_ingest<H: Host>(&mut self, host: &H, body: &[u8]) -> Flow {
        let (check, vm_id, queue) = {
            let w = self.worker.borrow();
            (
                ingest::check_body(&w.config, body),
                w.config.vm_id.clone(),
                w.config.queue_name.clone(),
            )
        };
        let r = match check {
            Err(r) => {
                host.metric_add(MetricKind::Counter, metric::INGEST_REJECTED, 1);
                r
            }
            Ok(()) => match host.enqueue(&vm_id, &queue, body) {
                Ok(()) => {
                    host.metric_add(MetricKind::Counter, metric::INGEST_ACCEPTED, 1);
                    ingest::accepted()
                }
                Err(e) => {
                    host.log(Level::Error, &format!("kvroute: ingest enqueue failed: {e}"));
                    ingest::queue_unavailable()
                }
            },
        };
        self.reply(host, r.status, &r.body, &[]);
        Flow::Pause
    }

    fn decide<H: Host>(&mut self, host: &H, body: Option<&[u8]>) -> Flow {
        self.decided = true;
        let started = host.now_ms();
        let decision = self.worker.borrow_mut().decide(host, &self.path, body);
        let flow = self.apply(host, decision, body);
        host.metric_record(
            MetricKind::Histogram,
            metric::DECISION_US,
            host.now_ms().saturating_sub(started).saturating_mul(1000),
        );
        flow
    }

    fn apply<H: Host>(&mut self, host: &H, decision: Decision, body: Option<&[u8]>) -> Flow {
        let (fail_open, admission) = {
            let w = self.worker.borrow();
            (w.config.fail_open, w.config.admission.clone())
        };
        match decision {
            Decision::Route {
                header,
                value,
                endpoint,
                tokens,
                reason,
                facts,
            } => {
                self.held = self
                    .worker
                    .borrow_mut()
                    .apply_route(host, &header, &value, &endpoint, tokens, &reason);
                self.facts = facts;
                self.reason = reason;
                self.decided_at_ms = host.now_ms();
                Flow::Continue
            }
            Decision::NoEndpoints => {
                host.metric_add(MetricKind::Counter, metric::NO_ENDPOINTS, 1);
                self.reply(host, 503, &json_error("no_endpoints"), &[]);
                Flow::Pause
            }
            Decision::NoCapacity { priority, size } => {
                if admission.enabled {
                    let parked = Parked {
                        context_id: self.context_id,
                        path: self.path.clone(),
                        body: body.map(|b| b.to_vec()).unwrap_or_default(),
                    };
                    let now = host.now_ms();
                    let pushed = {
                        let mut w = self.worker.borrow_mut();
                        let r = w.admission.push(parked, priority, size, now);
                        host.metric_record(MetricKind::Gauge, metric::QUEUE_LENGTH, w.admission.len() as u64);
                        r
                    };
                    if pushed.is_ok() {
                        host.metric_add(MetricKind::Counter, metric::QUEUED, 1);
                        self.queued = true;
                        return Flow::Pause;
                    }
                }
                host.metric_add(MetricKind::Counter, metric::REJECTED, 1);
                let ra = admission.retry_after_s.to_string();
                self.reply(host, 429, &json_error("saturated"), &[("retry-after", &ra)]);
                Flow::Pause
            }
            Decision::FailOpen(why) => {
                host.metric_add(MetricKind::Counter, metric::FAIL_OPEN, 1);
                host.log(Level::Debug, &format!("kvroute: fail open: {why}"));
                if fail_open {
                    self.reason = "fail_open".into();
                    Flow::Continue
                } else {
                    self.reply(host, 503, &json_error("router_unavailable"), &[]);
                    Flow::Pause
                }
            }
        }
    }

    /// Response headers arrived.
    pub fn on_response_headers<H: Host>(&mut self, host: &H) -> Flow {
        if self.role() == Role::Ingest || self.replied {
            return Flow::Continue;
        }
        self.adopt_resumed(host);
        if self.decided_at_ms > 0 {
            host.metric_record(
                MetricKind::Histogram,
                metric::TTFB_MS,
                host.now_ms().saturating_sub(self.decided_at_ms),
            );
        }
        let (debug, tail) = {
            let w = self.worker.borrow();
            (w.config.debug_header, w.config.usage_tail_bytes)
        };
        if debug && !self.reason.is_empty() {
            host.set_response_header(DECISION_HEADER, &self.reason);
        }
        let sse = host
            .response_header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"));
        self.resp = if sse {
            Resp::Sse(SseUsageScanner::new(tail))
        } else {
            Resp::Json {
                tail: Vec::new(),
                total: 0,
            }
        };
        Flow::Continue
    }

    /// A response body chunk of `size` bytes arrived (never buffered).
    pub fn on_response_body<H: Host>(&mut self, host: &H, size: usize, end_of_stream: bool) -> Flow {
        if matches!(self.resp, Resp::None) {
            return Flow::Continue;
        }
        let cap = self.worker.borrow().config.usage_tail_bytes;
        if size > 0 {
            if let Some(chunk) = host.response_body(size) {
                match &mut self.resp {
                    Resp::Sse(s) => s.feed(&chunk),
                    Resp::Json { tail, total } => {
                        *total = total.saturating_add(chunk.len());
                        tail.extend_from_slice(&chunk);
                        if tail.len() > cap {
                            let cut = tail.len() - cap;
                            tail.drain(..cut);
                        }
                    }
                    Resp::None => {}
                }
            }
        }
        if end_of_stream {
            let u = match std::mem::take(&mut self.resp) {
                Resp::Sse(mut s) => {
                    s.finish();
                    s.usage()
                }
                Resp::Json { tail, total } => {
                    if total == tail.len() {
                        usage::parse_json(&tail).or_else(|| usage::parse_json_tail(&tail))
                    } else {
                        usage::parse_json_tail(&tail)
                    }
                }
                Resp::None => None,
            };
            if let Some(u) = u {
                let facts = self.facts.clone();
                self.worker.borrow_mut().observe_usage(host, &facts, u.prompt_tokens);
            }
            self.release(host);
        }
        Flow::Continue
    }

    fn adopt_resumed<H: Host>(&mut self, host: &H) {
        if self.queued {
            let got = self.worker.borrow_mut().resumed.remove(&self.context_id);
            if let Some((held, facts, at)) = got {
                self.held = Some(held);
                self.facts = facts;
                self.decided_at_ms = at;
                self.queued = false;
            }
        }
        let _ = host;
    }

    fn release<H: Host>(&mut self, host: &H) {
        if let Some(h) = self.held.take() {
            self.worker.borrow_mut().release(host, &h);
        }
    }

    /// The stream is finished (completed, reset, or failed). Releases any reservation and
    /// leaves the admission queue.
    pub fn on_done<H: Host>(&mut self, host: &H) {
        self.adopt_resumed(host);
        if self.queued {
            let id = self.context_id;
            let mut w = self.worker.borrow_mut();
            w.admission.remove_where(|p| p.context_id == id);
            host.metric_record(MetricKind::Gauge, metric::QUEUE_LENGTH, w.admission.len() as u64);
        }
        self.release(host);
    }
}
