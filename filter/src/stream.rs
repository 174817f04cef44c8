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
//! A saturated request (admission on) is held in the admission queue only when its body was
//! read or it has none: one whose body follows unread streams once decided, and holding it
//! would make Envoy buffer that body until its own 413, so it is answered 429 at once.
//!
//! Response side: never buffered, and its headers are not read (only a body-less
//! response's `:status`). The time from decision to response headers is recorded as TTFB,
//! and the router's sampler chooses whether this response is read for `usage`
//! ([`Worker::sample_usage`]: a token bucket per model). If it is, the first body bytes tell
//! SSE, JSON or neither apart ([`BodyFraming::sniff`]), and each body chunk is copied into
//! a bounded `usage` scanner (SSE) or a bounded tail (JSON); if not, no chunk is read and
//! the request's `stream` field stands for the sniff. An event stream's first token (its
//! first `data` event, not a keep-alive comment, a data-less event, `[DONE]`, an error or a Responses
//! API lifecycle event: [`FirstTokenScanner`]), before the end, marks the request's prefill
//! done in the worker's in-flight table (its pending prefill tokens drop to 0) and gives a
//! TTFT sample. Until it shows, an unread stream's chunks are read too, at most
//! `FIRST_TOKEN_MAX_CHUNKS` (64) in all; past that the release ends the prefill. At
//! response end the usage, if read, calibrates the estimator and the reservation is released
//! (in memory; the other workers see it with the next publication: [`Worker::release`]). `on_done`
//! releases too, so client resets and upstream errors release; a reservation is released
//! exactly once ([`Option::take`]).
//!
//! Role `ingest` has its own stream type: [`crate::ingest::IngestStream`].

use crate::host::{Host, Level, MetricKind};
use crate::names::{metric, DECISION_HEADER, FAIL_OPEN_REASON};
use crate::reply::{self, LocalReply};
use crate::router::{Decision, Held, Parked, RequestFacts, Resumed, Routed, Worker};
use kvroute_core::usage::{self, BodyFraming, FirstTokenScanner, SseUsageScanner};
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
    /// Response headers seen; the first body bytes tell the framing (held here until
    /// they do, at most [`SNIFF_MAX_BYTES`]).
    Pending(Vec<u8>),
    /// Nothing (more) to read for `usage`: not chosen for it ([`Worker::sample_usage`]), or
    /// neither SSE nor JSON (compressed, an HTML or text error). No chunk is read, except
    /// while an event stream's first token is awaited ([`Stream::first`]); the end releases
    /// the reservation.
    Unread,
    Sse(SseUsageScanner),
    Json {
        tail: Vec<u8>,
        total: usize,
    },
}

/// Response bytes held while their framing is undecided (whitespace, or a prefix of an
/// SSE field name); past this the body is [`BodyFraming::Other`].
const SNIFF_MAX_BYTES: usize = 64;

/// Chunks of an event stream not read for `usage`, the first included, looked at for its
/// first token ([`FirstTokenScanner`]); past them the request's prefill ends at the
/// release, as a non-stream's does, and gives no TTFT sample. A stream read for `usage` has
/// every chunk read anyway, so its first token is looked for in all of them.
///
/// Each look at an unread stream's chunk is a host call that returns data, the dearest
/// kind inside Envoy (~10 k instructions, docs/overhead.md "Host calls"), so the bound is
/// in chunks, not bytes: a keep-alive is ~10 bytes (`: ping\n\n`), and 4 KiB of them would
/// be hundreds of calls. Keep-alives come one per interval while a prefill runs: 15 s in
/// llmgateway (<https://github.com/theopenco/llmgateway/pull/1541>), an operator's choice in
/// LiteLLM (`sse_keepalive_ping_interval_seconds`, 5 s in its example,
/// <https://github.com/BerriAI/litellm/pull/37322>); llama.cpp's llama-server pings a silent
/// stream every second (<https://github.com/ggml-org/llama.cpp/pull/25241>), so 64 chunks
/// cover a minute of prefill there and 5 to 16 min behind those gateways. They cost at most
/// 63 reads (~0.6 M instructions) more than a stream whose first chunk holds its first
/// token (which costs what it did before: one read), spread over that minute or more.
const FIRST_TOKEN_MAX_CHUNKS: u32 = 64;

/// An event stream whose first token has not shown yet.
#[derive(Debug, Default)]
struct AwaitFirstToken {
    scanner: FirstTokenScanner,
    /// Chunks looked at so far.
    chunks: u32,
}

/// Remove from the request the headers a client could choose its own backend (or fake a
/// decision) with: the routing header of either mode and [`DECISION_HEADER`], each one
/// `present` says the request has. The filter does it to every request before it decides,
/// and the native build also when it fails open (a panic, no worker), so that an unrouted
/// request takes Envoy's default route, not the backend a client named.
pub fn strip_client_routing<H: Host>(
    host: &H,
    config: &kvroute_core::plugin_config::Config,
    present: [bool; 3],
) {
    for (name, present) in client_routing_headers(config).into_iter().zip(present) {
        if present {
            host.set_request_header(name, None);
        }
    }
}

/// The headers [`strip_client_routing`] removes, in the order of its `present`: the
/// cluster mode's routing header, the endpoint mode's, and [`DECISION_HEADER`].
pub fn client_routing_headers(config: &kvroute_core::plugin_config::Config) -> [&str; 3] {
    [
        config.cluster_header.as_str(),
        config.endpoint_header.as_str(),
        DECISION_HEADER,
    ]
}

/// What a decision has of the request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body<'a> {
    /// There is none (end of stream at the request headers). Nothing follows for Envoy to
    /// buffer, so a saturated request of this kind can be held in the admission queue.
    None,
    /// One follows that the filter does not read: over `max_body_bytes` (declared, or
    /// buffered past it), `Content-Encoding`, or an upgrade's stream. It is
    /// routed by load alone and streams once decided; it is never held, since a paused
    /// stream makes Envoy buffer the body until `per_connection_buffer_limit_bytes`, where
    /// Envoy answers its own 413.
    Unread,
    /// The whole body, read (Envoy buffered it).
    Read(&'a [u8]),
}

impl<'a> Body<'a> {
    /// The body the router reads: `None` when it has none to read.
    fn read(self) -> Option<&'a [u8]> {
        match self {
            Body::Read(b) => Some(b),
            Body::None | Body::Unread => None,
        }
    }
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
    /// Request body bytes buffered so far (read again when trailers end the request).
    body_len: usize,
    held: Option<Held>,
    facts: RequestFacts,
    decided_at_ms: u64,
    reason: String,
    resp: Resp,
    /// This response is read for `usage` ([`Worker::sample_usage`], at its headers).
    read_usage: bool,
    /// Set while an event stream's first token is awaited: from the sniff that tells an
    /// event stream (when the request holds pending prefill) until the token shows, the
    /// stream ends, or, unread, [`FIRST_TOKEN_MAX_CHUNKS`] chunks showed none.
    first: Option<AwaitFirstToken>,
    /// The routing header's value this stream's decision set (the cluster in cluster mode,
    /// `primary,fallback...` hosts in endpoint mode); empty when it was not routed. Kept,
    /// not read back: Envoy lets a filter read the request headers only until it lets them
    /// go (a request decided at its headers, or resumed from the admission queue), and the
    /// SDK's read panicked on the status it gets after that.
    routed_to: String,
    /// Endpoint mode, when this response checks the routing ([`Worker::upstream_check_due`])
    /// against [`Self::routed_to`], one of whose hosts Envoy must reach.
    check_upstream: bool,
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
            body_len: 0,
            held: None,
            facts: RequestFacts::default(),
            decided_at_ms: 0,
            reason: String::new(),
            resp: Resp::None,
            read_usage: false,
            first: None,
            routed_to: String::new(),
            check_upstream: false,
        }
    }

    fn reply<H: Host>(&mut self, host: &H, r: &LocalReply) {
        if self.replied {
            return;
        }
        self.replied = true;
        r.send(host);
    }

    /// Request headers arrived.
    pub fn on_request_headers<H: Host>(&mut self, host: &H, end_of_stream: bool) -> Flow {
        // Every header this callback reads: one host call for the map (instead of one per
        // header) and one walk over it (instead of one per name).
        let headers = host.request_headers();
        let (found, max) = {
            let w = self.worker.borrow();
            let [cluster, endpoint, decision] = client_routing_headers(&w.config);
            let names = [
                ":path",
                ":method",
                "upgrade",
                "content-encoding",
                "content-length",
                cluster,
                endpoint,
                decision,
            ];
            (headers.get_all(names), w.config.max_body_bytes)
        };
        let [path, method, upgrade, encoding, length, routing @ ..] = found;
        fn text(v: Option<&[u8]>) -> Option<&str> {
            v.and_then(|v| std::str::from_utf8(v).ok())
        }
        // A path or method that is not UTF-8 reads as none: not an inference request.
        self.path = text(path).unwrap_or_default().to_owned();
        if let Some(models) = reply::models_request(text(method), &self.path) {
            let catalog = self.worker.borrow_mut().cache.catalog(host).ok().flatten();
            if let Some(c) = catalog {
                host.metric_add(MetricKind::Counter, metric::MODELS_LISTED, 1);
                let r = c.reply(&models);
                self.reply(host, &r);
                return Flow::Pause;
            }
            // No snapshot yet: let the model servers answer.
        }
        {
            // The header names are read in place (no copy per request); the host calls
            // below do not reach the worker.
            let w = self.worker.borrow();
            // A client must not choose its own backend.
            strip_client_routing(host, &w.config, routing.map(|v| v.is_some()));
        }
        if method == Some(b"CONNECT".as_slice()) {
            // A tunnel, not an inference request (no OpenAI-style API uses CONNECT): it goes
            // on unrouted, nothing reserved, its client's routing headers removed above.
            // Routed by load, its reservation counted it in flight on an endpoint its route
            // need not reach, for the tunnel's whole life (found by a breaker); waiting for
            // its body's end would hold it until a timeout (a tunnel's body never ends).
            self.decided = true;
            return Flow::Continue;
        }
        // An upgrade (a WebSocket session, such as a realtime API's) streams both ways
        // without a body's end: decided now, by load.
        let upgrade = upgrade.is_some();
        let encoded = encoding.is_some_and(crate::headers::encodes);
        let too_big = text(length)
            .and_then(|l| l.trim().parse::<u64>().ok())
            .is_some_and(|l| l > max as u64);
        if end_of_stream {
            return self.decide(host, Body::None);
        }
        if upgrade || encoded || too_big {
            return self.decide(host, Body::Unread);
        }
        Flow::Pause
    }

    /// A request body chunk arrived; `buffered` is the total buffered size.
    pub fn on_request_body<H: Host>(
        &mut self,
        host: &H,
        buffered: usize,
        end_of_stream: bool,
    ) -> Flow {
        self.adopt_resumed(host);
        if self.replied || self.queued {
            // Answered, or parked in the admission queue: it continues only on resume.
            return Flow::Pause;
        }
        self.body_len = buffered;
        if self.decided {
            return Flow::Continue;
        }
        let max = self.worker.borrow().config.max_body_bytes;
        if buffered > max {
            return self.decide(host, Body::Unread);
        }
        if !end_of_stream {
            return Flow::Pause;
        }
        host.with_request_body(buffered, |b| {
            self.decide(host, Body::Read(b.unwrap_or_default()))
        })
    }

    /// Request trailers arrived (HTTP/2, or HTTP/1 chunked with trailers enabled): the body
    /// ended without an end-of-stream data frame, so trailers end the request. Decide (or
    /// finish the ingest) now on the buffered body, as [`Self::on_request_body`] does at end
    /// of stream; without this, proxy-wasm's default `Continue` let such a request through
    /// with no decision.
    pub fn on_request_trailers<H: Host>(&mut self, host: &H) -> Flow {
        self.adopt_resumed(host);
        if self.replied || self.queued {
            return Flow::Pause;
        }
        if self.decided {
            return Flow::Continue;
        }
        host.with_request_body(self.body_len, |b| {
            self.decide(host, Body::Read(b.unwrap_or_default()))
        })
    }

    fn decide<H: Host>(&mut self, host: &H, body: Body<'_>) -> Flow {
        self.decided = true;
        // One clock read serves the decision, the reservation and the TTFB start.
        let started = host.now_us();
        let decision =
            self.worker
                .borrow_mut()
                .decide(host, &self.path, body.read(), started / 1_000);
        let flow = self.apply(host, decision, body);
        host.metric_record(
            MetricKind::Histogram,
            metric::DECISION_US,
            host.now_us().saturating_sub(started),
        );
        flow
    }

    fn apply<H: Host>(&mut self, host: &H, decision: Decision, body: Body<'_>) -> Flow {
        let (fail_open, admission) = {
            let w = self.worker.borrow();
            (w.config.fail_open, w.config.admission.clone())
        };
        match decision {
            Decision::Route(mut routed) => {
                let held = self.worker.borrow_mut().apply_route(host, &mut routed);
                let Routed {
                    value,
                    reason,
                    route,
                    at_ms,
                    ..
                } = *routed;
                self.check_upstream = self
                    .worker
                    .borrow()
                    .upstream_check_due(&held.endpoint, at_ms);
                self.routed_to = value;
                self.held = Some(held);
                self.facts = route.facts;
                self.reason = reason;
                self.decided_at_ms = at_ms;
                Flow::Continue
            }
            d @ (Decision::NoEndpoints(_) | Decision::UnknownModel(_)) => {
                let r = self.worker.borrow().unserved_reply(host, &d);
                if let Some(r) = r {
                    self.reply(host, &r);
                }
                Flow::Pause
            }
            Decision::NoCapacity { priority, size } => {
                // A body the filter does not read is never held ([`Body::Unread`]): it gets
                // the 429 of a full queue.
                if admission.enabled && body == Body::Unread {
                    host.log(
                        Level::Debug,
                        "kvroute: saturated, not held: its body is not read (Envoy would buffer it)",
                    );
                } else if admission.enabled {
                    let body = body.read().unwrap_or_default();
                    let bytes = Parked::bytes_of(&self.path, body);
                    let now = host.now_ms();
                    let pushed = {
                        let mut w = self.worker.borrow_mut();
                        // Checked before the copy: a refused body is never copied.
                        let r = w.admission.admits(bytes).and_then(|_| {
                            let parked = Parked {
                                context_id: self.context_id,
                                path: self.path.clone(),
                                body: body.to_vec(),
                            };
                            w.admission
                                .push(parked, priority, size, bytes, now)
                                .map_err(|e| e.bound)
                        });
                        w.report_queue_length(host);
                        r
                    };
                    match pushed {
                        Ok(()) => {
                            host.metric_add(MetricKind::Counter, metric::QUEUED, 1);
                            self.queued = true;
                            return Flow::Pause;
                        }
                        Err(bound) => host.log(
                            Level::Debug,
                            &format!(
                                "kvroute: saturated, not held: admission queue is full ({bound})"
                            ),
                        ),
                    }
                }
                host.metric_add(MetricKind::Counter, metric::REJECTED, 1);
                self.reply(host, &reply::saturated(admission.retry_after_s));
                Flow::Pause
            }
            Decision::FailOpen(why) => {
                host.metric_add(MetricKind::Counter, metric::FAIL_OPEN, 1);
                host.log(Level::Debug, &format!("kvroute: fail open: {why}"));
                if fail_open {
                    self.reason = FAIL_OPEN_REASON.into();
                    Flow::Continue
                } else {
                    let ra = self.worker.borrow().config.admission.retry_after_s;
                    self.reply(host, &reply::router_unavailable(ra));
                    Flow::Pause
                }
            }
        }
    }

    /// Cluster mode: Envoy's router answered its own empty 503 because the cluster the
    /// filter named does not exist (`response.code_details` `cluster_not_found`, e.g. a
    /// typo or a defaulted `cluster` in kvroute-cp's config). Counted, logged with the
    /// cluster's name, and replaced by a 503 that says what is wrong. The attribute is read
    /// only for a 503 or a 404 (the router's `cluster_not_found_response_code` choices), so
    /// other responses cost no property call.
    fn missing_cluster<H: Host>(&mut self, host: &H, status: Option<&str>) -> Option<LocalReply> {
        // Endpoint mode names hosts, not a cluster: a cluster missing there is the route's.
        if !matches!(status, Some("503" | "404"))
            || self.worker.borrow().config.mode != kvroute_core::plugin_config::Mode::Cluster
        {
            return None;
        }
        if host.property(&["response", "code_details"]).as_deref() != Some("cluster_not_found") {
            return None;
        }
        // The cluster this filter chose; a request it did not route (failed open to the
        // default route) is not its to explain.
        if self.routed_to.is_empty() {
            return None;
        }
        let cluster = self.routed_to.clone();
        host.metric_add(MetricKind::Counter, metric::CLUSTER_NOT_FOUND, 1);
        host.log(
            Level::Warn,
            &format!(
                "kvroute: Envoy has no cluster `{cluster}` (chosen for endpoint `{}`): set pools[].endpoints[].cluster in kvroute-cp's config to an Envoy cluster name; answered 503 cluster_not_found",
                self.held.as_ref().map_or("?", |h| h.endpoint.as_str())
            ),
        );
        Some(reply::cluster_not_found(&cluster))
    }

    /// Endpoint mode: compare the upstream Envoy reached (`upstream.address`) with the
    /// endpoint header's `hosts`. Envoy's `override_host` policy sends a request whose hosts
    /// its cluster does not have (a host name, an IP outside the cluster or written
    /// otherwise), or whose hosts all failed, wherever its fallback policy does, silently;
    /// this makes that visible: counted
    /// (`kvroute.outcome.upstream_mismatch`) and logged at warn, naming both. A response
    /// Envoy made itself (no upstream) is not compared.
    fn check_upstream<H: Host>(&self, host: &H) {
        let hosts = self.routed_to.as_str();
        let Some(endpoint) = self.held.as_ref().map(|h| h.endpoint.as_str()) else {
            return;
        };
        // Recorded at the decision's time, the clock `upstream_check_due` was asked with
        // (no clock read of its own).
        self.worker
            .borrow_mut()
            .upstream_checked(endpoint, self.decided_at_ms);
        let Some(upstream) = host.property(&["upstream", "address"]) else {
            return;
        };
        if hosts.split(',').any(|h| h == upstream) {
            return;
        }
        host.metric_add(MetricKind::Counter, metric::UPSTREAM_MISMATCH, 1);
        host.log(
            Level::Warn,
            &format!(
                "kvroute: endpoint mode: a request routed to endpoint {endpoint} ({hosts}) \
                 reached upstream {upstream}, none of those: Envoy's fallback policy chose it, \
                 because the cluster has no host at a listed address (give endpoints the \
                 cluster hosts' IPs, written as Envoy writes them) or every listed host \
                 failed (docs/filter.md, \"Endpoint mode\")"
            ),
        );
    }

    /// Response headers arrived; `end_of_stream` when no body follows.
    ///
    /// A response with a body has none of its headers read: its framing (SSE or JSON) is
    /// told from its first body bytes ([`BodyFraming::sniff`]), because a header read is a
    /// host call that returns data, one of the dearest inside Envoy (docs/overhead.md).
    /// Only a body-less response has its `:status` read: Envoy's own `cluster_not_found`
    /// reply is one ([`Self::missing_cluster`]).
    pub fn on_response_headers<H: Host>(&mut self, host: &H, end_of_stream: bool) -> Flow {
        if self.replied {
            return Flow::Continue;
        }
        self.adopt_resumed(host);
        if std::mem::take(&mut self.check_upstream) {
            self.check_upstream(host);
        }
        if end_of_stream {
            let status = host.response_header(":status");
            if let Some(r) = self.missing_cluster(host, status.as_deref()) {
                self.reply(host, &r);
                return Flow::Pause;
            }
        }
        // Only a response this filter routed has anything to learn from. Of those, a sample
        // is read for `usage` (`kvroute_core::usage_sample`); the others cost no host call
        // in their body callbacks.
        self.resp = Resp::None;
        self.first = None;
        if self.decided_at_ms > 0 {
            let now = host.now_ms();
            host.metric_record(
                MetricKind::Histogram,
                metric::TTFB_MS,
                now.saturating_sub(self.decided_at_ms),
            );
            self.read_usage = self.worker.borrow_mut().sample_usage(&self.facts, now);
            // An unread response to a streamed request still has its first bytes sniffed,
            // so that an event stream's first token ends its prefill and gives a TTFT
            // sample while an error reply (JSON, HTML) does not: one chunk read, more only
            // while the stream shows no token (keep-alives), at most FIRST_TOKEN_MAX_CHUNKS.
            self.resp = if self.read_usage || self.facts.stream {
                Resp::Pending(Vec::new())
            } else {
                Resp::Unread
            };
        }
        if self.worker.borrow().config.debug_header && !self.reason.is_empty() {
            host.set_response_header(DECISION_HEADER, &self.reason);
        }
        Flow::Continue
    }

    /// A response body chunk of `size` bytes arrived (never buffered).
    pub fn on_response_body<H: Host>(
        &mut self,
        host: &H,
        size: usize,
        end_of_stream: bool,
    ) -> Flow {
        match self.resp {
            Resp::None => return Flow::Continue,
            // Nothing to read: no `usage`, and no first token awaited, or the end, where a
            // first token no longer matters (the release clears the prefill now).
            Resp::Unread if self.first.is_none() || end_of_stream => {
                if end_of_stream {
                    self.resp = Resp::None;
                    self.first = None;
                    self.release();
                }
                return Flow::Continue;
            }
            _ => {}
        }
        let cap = self.worker.borrow().config.usage_tail_bytes;
        let mut chunk = if size > 0 {
            host.response_body(size)
        } else {
            None
        };
        if let Resp::Pending(head) = &mut self.resp {
            if let Some(c) = chunk.take() {
                // The usual case decides on the first chunk alone, without copying it.
                let first = match head.is_empty() {
                    true => BodyFraming::sniff(&c),
                    false => None,
                };
                let (framing, feed) = match first {
                    Some(f) => (Some(f), Some(c)),
                    None => {
                        head.extend_from_slice(&c);
                        let f = BodyFraming::sniff(head).or_else(|| {
                            // Still undecided after this many bytes (whitespace): not a stream.
                            (head.len() > SNIFF_MAX_BYTES).then_some(BodyFraming::Other)
                        });
                        // Once decided, the bytes held so far are fed as this chunk.
                        let held = f.map(|_| std::mem::take(head));
                        (f, held)
                    }
                };
                chunk = feed;
                if let Some(f) = framing {
                    self.resp = match f {
                        // Sniffed only: a first token is all it gives (below).
                        _ if !self.read_usage => Resp::Unread,
                        BodyFraming::EventStream => Resp::Sse(SseUsageScanner::new(cap)),
                        BodyFraming::Json => Resp::Json {
                            tail: Vec::new(),
                            total: 0,
                        },
                        BodyFraming::Other => Resp::Unread,
                    };
                    // Only an event stream's first token ends the prefill while the request
                    // is still running; a JSON body's first bytes come after the whole
                    // generation, just before the release that clears the prefill anyway.
                    let pending = self.held.as_ref().is_some_and(|h| h.prefill_tokens > 0);
                    if f == BodyFraming::EventStream && pending {
                        self.first = Some(AwaitFirstToken::default());
                    }
                }
            }
        }
        let found = match (self.first.as_mut(), chunk.as_deref()) {
            (Some(look), Some(c)) => {
                look.chunks += 1;
                let found = look.scanner.feed(c);
                // The bound saves reads: a stream read for `usage` is read to its end anyway.
                if found || (!self.read_usage && look.chunks >= FIRST_TOKEN_MAX_CHUNKS) {
                    self.first = None;
                }
                found
            }
            _ => false,
        };
        if found && !end_of_stream {
            self.first_token(host);
        }
        if let Some(chunk) = chunk {
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
                Resp::None | Resp::Pending(_) | Resp::Unread => {}
            }
        }
        if end_of_stream {
            self.first = None;
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
                Resp::None | Resp::Pending(_) | Resp::Unread => None,
            };
            if let Some(u) = u {
                let facts = self.facts.clone();
                let mut w = self.worker.borrow_mut();
                w.observe_usage(host, &facts, u.prompt_tokens);
                if let Some(model) = facts.model.as_deref() {
                    let api = kvroute_core::analysis::ApiKind::from_path(&self.path);
                    // `completion_tokens` covers all `n` choices; the learner is per choice.
                    let per_choice = facts.per_choice(u.completion_tokens);
                    w.observe_output(model, api, u.prompt_tokens, per_choice);
                }
            }
            self.release();
        }
        Flow::Continue
    }

    /// A streamed response's first token arrived (its first `data` event,
    /// [`FirstTokenScanner`]): the request's prefill is over (the release at the end clears
    /// it otherwise), and the time since the decision is this endpoint's TTFT, a
    /// prefill-throughput sample. Once per stream (the held prefill drops to 0).
    fn first_token<H: Host>(&mut self, host: &H) {
        let Some(h) = self.held.as_mut().filter(|h| h.prefill_tokens > 0) else {
            return;
        };
        self.worker.borrow_mut().prefill_done(h);
        h.prefill_tokens = 0;
        if self.decided_at_ms > 0 {
            let ttft_s = host.now_ms().saturating_sub(self.decided_at_ms) as f64 / 1e3;
            self.worker.borrow_mut().observe_first_token(
                &h.endpoint,
                self.facts.predicted_work_tokens,
                ttft_s,
            );
        }
    }

    fn adopt_resumed<H: Host>(&mut self, host: &H) {
        if self.queued {
            let got = self.worker.borrow_mut().resumed.remove(&self.context_id);
            if let Some(Resumed {
                route,
                reason,
                routed_to,
                check_upstream,
            }) = got
            {
                self.queued = false;
                self.reason = reason;
                self.routed_to = routed_to;
                self.check_upstream = check_upstream;
                if let Some((held, facts, at)) = route {
                    self.held = Some(held);
                    self.facts = facts;
                    self.decided_at_ms = at;
                }
            }
        }
        let _ = host;
    }

    fn release(&mut self) {
        if let Some(h) = self.held.take() {
            self.worker.borrow_mut().release(&h);
        }
    }

    /// Leave the admission queue if parked there (a resumption the tick already decided is
    /// adopted first, so that its reservation goes with the stream): the stream is done, or
    /// (the native build) one of its request hooks failed open and it goes on unrouted.
    pub fn leave_queue<H: Host>(&mut self, host: &H) {
        self.adopt_resumed(host);
        if self.queued {
            let id = self.context_id;
            let mut w = self.worker.borrow_mut();
            w.admission.remove_where(|p| p.context_id == id);
            w.report_queue_length(host);
            self.queued = false;
        }
    }

    /// The stream is finished (completed, reset, or failed). Releases any reservation and
    /// leaves the admission queue.
    pub fn on_done<H: Host>(&mut self, host: &H) {
        self.leave_queue(host);
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;
    use crate::names::{metric, DECISION_PROPERTY};
    use crate::router::UPSTREAM_CHECK_MS;
    use crate::shared;
    use kvroute_core::plugin_config::Config;
    use kvroute_core::snapshot::{EndpointStats, Snapshot};

    const NOW: u64 = 1_000_000;

    fn ep(i: usize, kv: f64) -> EndpointStats {
        EndpointStats {
            address: format!("10.0.0.{i}:8000"),
            kv_usage: Some(kv),
            ..EndpointStats::fixture(i, NOW)
        }
    }

    fn setup(cfg: &str, eps: Vec<EndpointStats>) -> (MockHost, Rc<RefCell<Worker>>) {
        let snap = (!eps.is_empty()).then(|| Snapshot::new(1, NOW, eps));
        setup_snapshot(cfg, snap)
    }

    /// [`setup`] with a whole snapshot in force (`None`: none received yet).
    fn setup_snapshot(cfg: &str, snap: Option<Snapshot>) -> (MockHost, Rc<RefCell<Worker>>) {
        let h = MockHost::new(NOW);
        if let Some(snap) = snap {
            shared::publish_snapshot(&h, &snap.encode()).unwrap();
        }
        shared::ensure_keys(&h).unwrap();
        let mut w = Worker::new(Config::parse(cfg.as_bytes()).unwrap(), 1).unwrap();
        w.set_worker_number(shared::next_worker_number(&h).unwrap());
        (h, Rc::new(RefCell::new(w)))
    }

    const BODY: &[u8] =
        br#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":10}"#;

    fn request(h: &MockHost, path: &str, body: &[u8]) -> MockHost {
        h.sibling()
            .with_header(":path", path)
            .with_header(":method", "POST")
            .with_header("x-kvroute-cluster", "spoofed")
            .with_body(body)
    }

    /// `r` answered by Envoy itself with `status` and code details `cluster_not_found` (the
    /// cluster the filter named does not exist).
    fn cluster_not_found(r: MockHost, status: &str) -> MockHost {
        let r = r.with_property("response.code_details", "cluster_not_found");
        r.resp_headers
            .borrow_mut()
            .insert(":status".into(), status.into());
        r
    }

    /// A `GET path` request (no body) on a sibling of `h`.
    fn get(h: &MockHost, path: &str) -> MockHost {
        h.sibling()
            .with_header(":path", path)
            .with_header(":method", "GET")
    }

    /// `GET /v1/models` on stream `ctx`, which the filter answers itself from the snapshot:
    /// its one local reply.
    fn model_list_reply(
        h: &MockHost,
        w: &Rc<RefCell<Worker>>,
        ctx: u32,
    ) -> crate::host::mock::LocalReply {
        models_reply(h, w, ctx, "/v1/models")
    }

    /// The filter's one local reply to `GET path` on stream `ctx`.
    fn models_reply(
        h: &MockHost,
        w: &Rc<RefCell<Worker>>,
        ctx: u32,
        path: &str,
    ) -> crate::host::mock::LocalReply {
        let r = get(h, path);
        let mut s = Stream::new(w.clone(), ctx);
        assert_eq!(s.on_request_headers(&r, true), Flow::Pause);
        let replies = r.replies();
        assert_eq!(replies.len(), 1);
        replies[0].clone()
    }

    /// A one-message chat request for `model` on stream `ctx`, which the filter answers
    /// itself (it must pause): its one local reply.
    fn local_reply_to(
        h: &MockHost,
        w: &Rc<RefCell<Worker>>,
        model: &str,
        ctx: u32,
    ) -> crate::host::mock::LocalReply {
        let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"x"}}]}}"#);
        let r = request(h, "/v1/chat/completions", body.as_bytes());
        let mut s = Stream::new(w.clone(), ctx);
        s.on_request_headers(&r, false);
        assert_eq!(s.on_request_body(&r, body.len(), true), Flow::Pause);
        let replies = r.replies();
        assert_eq!(replies.len(), 1);
        replies[0].clone()
    }

    /// A chat request routed (headers, body, decision) and its response headers seen: the
    /// request host, the stream and the prompt-token estimate.
    fn routed_to_response(h: &MockHost, w: &Rc<RefCell<Worker>>) -> (MockHost, Stream, u64) {
        let r = request(h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w.clone(), 2);
        s.on_request_headers(&r, false);
        s.on_request_body(&r, BODY.len(), true);
        let est = s.facts.prompt_tokens;
        s.on_response_headers(&r, false);
        (r, s, est)
    }

    /// The worker's in-flight table as it last published it for the other workers
    /// (`crate::inflight`: 8 bytes of publication time, then the table).
    fn published(h: &MockHost) -> kvroute_core::inflight::InflightTable {
        let (v, _) = h.shared_get("kvroute.inflight.1").unwrap();
        let v = v.unwrap_or_default();
        kvroute_core::inflight::InflightTable::decode(v.get(8..).unwrap_or_default()).unwrap()
    }

    fn held(h: &MockHost) -> u64 {
        published(h).totals(NOW).values().map(|v| v.tokens).sum()
    }

    #[test]
    fn body_request_pauses_then_routes_and_releases_once() {
        let (h, w) = setup(
            r#"{"picker":{"policy":"least_kv"}}"#,
            vec![ep(0, 0.9), ep(1, 0.1)],
        );
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w, 2);
        assert_eq!(s.on_request_headers(&r, false), Flow::Pause);
        assert_eq!(
            r.header("x-kvroute-cluster"),
            None,
            "client header stripped"
        );
        assert_eq!(s.on_request_body(&r, 10, false), Flow::Pause);
        assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Continue);
        assert_eq!(r.header("x-kvroute-cluster").as_deref(), Some("c1"));
        assert!(held(&h) > 0);
        assert_eq!(h.metric(metric::DECISIONS_POLICY), 1);
        s.on_done(&r);
        s.on_done(&r);
        // Releases reach the other workers (and the counter) with the tick.
        s.worker.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(held(&h), 0);
        assert_eq!(h.metric(metric::RESERVED), 1);
        assert_eq!(h.metric(metric::RELEASED), 1);
    }

    /// Header values that are not UTF-8 (HTTP allows them): the request is routed by its
    /// body, and a client's routing header is stripped whatever its bytes.
    #[test]
    fn header_values_that_are_not_utf8_are_read_as_bytes() {
        let (h, w) = setup(
            r#"{"picker":{"policy":"least_kv"}}"#,
            vec![ep(0, 0.9), ep(1, 0.1)],
        );
        let r = request(&h, "/v1/chat/completions", BODY)
            .with_raw_header("x-latin1", b"caf\xe9")
            .with_raw_header("x-kvroute-cluster", b"c0\xff");
        let mut s = Stream::new(w, 2);
        assert_eq!(s.on_request_headers(&r, false), Flow::Pause);
        assert_eq!(
            r.raw_headers
                .borrow()
                .iter()
                .map(|(k, _)| k.as_str())
                .collect::<Vec<_>>(),
            ["x-latin1"],
            "client routing header stripped"
        );
        assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Continue);
        assert_eq!(r.header("x-kvroute-cluster").as_deref(), Some("c1"));
        assert_eq!(h.metric(metric::DECISIONS_POLICY), 1);
        assert_eq!(h.metric(metric::DECISIONS_LOAD_ONLY), 0);
    }

    #[test]
    fn headers_only_too_large_and_encoded_decide_at_headers() {
        let (h, w) = setup("{\"max_body_bytes\":100}", vec![ep(0, 0.1)]);
        for extra in [
            None,
            Some(("content-length", "101")),
            Some(("content-encoding", "gzip")),
            Some(("upgrade", "websocket")),
        ] {
            let mut r = request(&h, "/v1/chat/completions", BODY);
            if let Some((k, v)) = extra {
                r = r.with_header(k, v);
            }
            let mut s = Stream::new(w.clone(), 3);
            let eos = extra.is_none();
            assert_eq!(s.on_request_headers(&r, eos), Flow::Continue, "{extra:?}");
            assert_eq!(r.header("x-kvroute-cluster").as_deref(), Some("c0"));
            s.on_done(&r);
        }
        assert_eq!(h.metric(metric::DECISIONS_LOAD_ONLY), 4);
        // Releases reach the other workers (and the counter) with the tick.
        w.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(held(&h), 0);
    }

    /// A CONNECT is a tunnel, not an inference request: it goes on at its headers and its
    /// data flows, with no routing header set, nothing reserved and no decision counted;
    /// the routing headers its client sent are removed.
    #[test]
    fn a_connect_tunnel_goes_on_unrouted() {
        let (h, w) = setup("{}", vec![ep(0, 0.1)]);
        let r = request(&h, "/", b"tunnel bytes")
            .with_header(":method", "CONNECT")
            .with_header("x-kvroute-cluster", "c0");
        let mut s = Stream::new(w.clone(), 3);
        assert_eq!(s.on_request_headers(&r, false), Flow::Continue);
        assert_eq!(r.header("x-kvroute-cluster"), None);
        assert_eq!(s.on_request_body(&r, 12, false), Flow::Continue);
        assert_eq!(s.on_request_body(&r, 24, false), Flow::Continue);
        w.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(held(&h), 0);
        assert_eq!(h.metric(metric::DECISIONS_LOAD_ONLY), 0);
        assert_eq!(h.metric(metric::DECISIONS_POLICY), 0);
        assert_eq!(h.metric(metric::RESERVED), 0);
        s.on_done(&r);
        assert_eq!(h.metric(metric::RELEASED), 0);
    }

    /// `content-encoding` that is empty, blank or `identity` (any case) encodes nothing: the
    /// body is read and routed by its prompt.
    #[test]
    fn an_empty_or_identity_content_encoding_reads_the_body() {
        let (h, w) = setup("{}", vec![ep(0, 0.1)]);
        for value in ["", " ", "identity", "IDENTITY", " identity "] {
            let r =
                request(&h, "/v1/chat/completions", BODY).with_header("content-encoding", value);
            let mut s = Stream::new(w.clone(), 3);
            assert_eq!(s.on_request_headers(&r, false), Flow::Pause, "{value:?}");
            assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Continue);
            s.on_done(&r);
        }
        assert_eq!(h.metric(metric::DECISIONS_POLICY), 5);
        assert_eq!(h.metric(metric::DECISIONS_LOAD_ONLY), 0);
    }

    #[test]
    fn chunked_body_growing_past_the_limit_is_routed_by_load() {
        let (h, w) = setup("{\"max_body_bytes\":100}", vec![ep(0, 0.1)]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w, 3);
        assert_eq!(s.on_request_headers(&r, false), Flow::Pause);
        assert_eq!(s.on_request_body(&r, 60, false), Flow::Pause);
        assert_eq!(s.on_request_body(&r, 160, false), Flow::Continue);
        assert_eq!(r.header("x-kvroute-cluster").as_deref(), Some("c0"));
        assert_eq!(s.on_request_body(&r, 200, true), Flow::Continue);
        assert_eq!(h.metric(metric::DECISIONS_LOAD_ONLY), 1);
        assert_eq!(h.metric(metric::RESERVED), 1);
    }

    #[test]
    fn unknown_model_is_a_404_and_unhealthy_model_a_503() {
        let mut sick = ep(1, 0.1);
        sick.models = vec!["sick".into()];
        sick.lora_adapters = vec!["sick-lora".into()];
        sick.healthy = false;
        let (h, w) = setup("{}", vec![ep(0, 0.1), sick]);
        let send = |model: &str, ctx: u32| local_reply_to(&h, &w, model, ctx);
        let r = send("other", 2);
        assert_eq!(r.status, 404);
        assert_eq!(
            String::from_utf8(r.body).unwrap(),
            reply::model_not_found("other").body
        );
        assert_eq!(
            r.headers,
            vec![("content-type".into(), "application/json".into())]
        );
        assert_eq!(h.metric(metric::MODEL_NOT_FOUND), 1);
        for (i, model) in ["sick", "sick-lora"].into_iter().enumerate() {
            let r = send(model, 3 + i as u32);
            assert_eq!(r.status, 503, "{model}");
            assert_eq!(
                String::from_utf8(r.body).unwrap(),
                reply::no_healthy_endpoint(Some(model), 1).body
            );
            assert!(r.headers.contains(&("retry-after".into(), "1".into())));
        }
        assert_eq!(h.metric(metric::NO_ENDPOINTS), 2);
        assert_eq!(h.metric(metric::MODEL_NOT_FOUND), 1);
        // A body the analysis rejects (`"n": "1"`): the 503 still names its model, which
        // the decision carries from the core's one read of it.
        let body = br#"{"model":"sick","messages":[{"role":"user","content":"x"}],"n":"1"}"#;
        let r = request(&h, "/v1/chat/completions", body);
        let mut s = Stream::new(w.clone(), 5);
        s.on_request_headers(&r, false);
        assert_eq!(s.on_request_body(&r, body.len(), true), Flow::Pause);
        let replies = r.replies();
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].status, 503);
        assert_eq!(
            String::from_utf8(replies[0].body.clone()).unwrap(),
            r#"{"error":{"code":"no_healthy_endpoint","message":"No healthy endpoint serves model `sick` right now; retry later.","param":null,"type":"server_error"}}"#
        );
        assert_eq!(h.metric(metric::PARSE_ERRORS), 1);
        assert_eq!(h.metric(metric::NO_ENDPOINTS), 3);
    }

    /// A model of a pool with no endpoint at all (the snapshot's `unavailable_models`:
    /// scale from zero, a rollout, a crash loop) gets the same 503 as a model whose
    /// endpoints are all unhealthy, which OpenAI clients retry, and is listed by
    /// `GET /v1/models`; an unknown model is still a 404.
    #[test]
    fn model_of_a_pool_without_endpoints_is_a_503_with_retry_after() {
        for (eps, listed) in [
            (vec![ep(0, 0.1)], vec!["m", "scaled-to-zero"]),
            (vec![], vec!["scaled-to-zero"]),
        ] {
            let mut snap = Snapshot::new(1, NOW, eps);
            snap.unavailable_models = vec!["scaled-to-zero".into()];
            let (h, w) = setup_snapshot("{}", Some(snap));
            let send = |model: &str, ctx: u32| local_reply_to(&h, &w, model, ctx);
            let r = send("scaled-to-zero", 2);
            assert_eq!(r.status, 503);
            assert_eq!(
                String::from_utf8(r.body).unwrap(),
                r#"{"error":{"code":"no_healthy_endpoint","message":"No healthy endpoint serves model `scaled-to-zero` right now; retry later.","param":null,"type":"server_error"}}"#
            );
            assert_eq!(
                r.headers,
                vec![
                    ("content-type".into(), "application/json".into()),
                    ("retry-after".into(), "1".into())
                ]
            );
            assert_eq!(h.metric(metric::NO_ENDPOINTS), 1);
            assert_eq!(send("other", 3).status, 404);
            assert_eq!(h.metric(metric::MODEL_NOT_FOUND), 1);
            let v: serde_json::Value =
                serde_json::from_slice(&model_list_reply(&h, &w, 4).body).unwrap();
            let ids: Vec<&str> = v["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap())
                .collect();
            assert_eq!(ids, listed);
        }
    }

    #[test]
    fn model_list_is_answered_from_the_snapshot() {
        let mut lora = ep(1, 0.1);
        lora.lora_adapters = vec!["sql".into()];
        let (h, w) = setup("{}", vec![ep(0, 0.1), lora]);
        // One reply (the helper asserts it), from the snapshot.
        let rep = model_list_reply(&h, &w, 2);
        assert_eq!(rep.status, 200);
        let v: serde_json::Value = serde_json::from_slice(&rep.body).unwrap();
        let ids: Vec<&str> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["m", "sql"]);
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][1]["parent"], "m");
        assert_eq!(h.metric(metric::MODELS_LISTED), 1);
        // One model: its object, or OpenAI's 404.
        let one = models_reply(&h, &w, 3, "/v1/models/sql");
        let v: serde_json::Value = serde_json::from_slice(&one.body).unwrap();
        assert_eq!(
            (one.status, &v["id"], &v["parent"]),
            (200, &"sql".into(), &"m".into())
        );
        let none = models_reply(&h, &w, 4, "/v1/models/gpt-x");
        let v: serde_json::Value = serde_json::from_slice(&none.body).unwrap();
        assert_eq!(
            (none.status, &v["error"]["code"]),
            (404, &"model_not_found".into())
        );
        assert_eq!(h.metric(metric::MODELS_LISTED), 3);
        // Before any snapshot the model servers answer it.
        let (h, w) = setup("{}", vec![]);
        let r = get(&h, "/v1/models");
        let mut s = Stream::new(w, 2);
        assert_eq!(s.on_request_headers(&r, true), Flow::Continue);
        assert!(r.replies().is_empty());
    }

    /// A request decided at its headers (no body) is named too, from the decision itself:
    /// Envoy no longer lets the filter read request headers it let go (here: the mock's
    /// headers cleared), and reading them then panicked the VM in the SDK.
    #[test]
    fn missing_cluster_is_named_from_the_decision_not_the_header() {
        let (h, w) = setup("{}", vec![ep(0, 0.1)]);
        let r = get(&h, "/v1/chat/completions");
        let mut s = Stream::new(w, 2);
        assert_eq!(s.on_request_headers(&r, true), Flow::Continue);
        assert_eq!(r.header("x-kvroute-cluster").as_deref(), Some("c0"));
        r.req_headers.borrow_mut().clear();
        let r = cluster_not_found(r, "503");
        r.take_calls();
        assert_eq!(s.on_response_headers(&r, true), Flow::Pause);
        assert!(!r.take_calls().iter().any(|(m, _)| *m == "request_header"));
        let rep = r.replies();
        assert_eq!(rep.len(), 1);
        assert_eq!(
            String::from_utf8(rep[0].body.clone()).unwrap(),
            reply::cluster_not_found("c0").body
        );
    }

    /// Endpoint mode sets hosts, not a cluster: a missing cluster there is the route's own,
    /// and Envoy's reply passes unchanged (no reply naming the hosts as a cluster).
    #[test]
    fn endpoint_mode_leaves_a_missing_cluster_to_envoy() {
        let (h, w) = setup(r#"{"mode":"endpoint"}"#, vec![ep(0, 0.1)]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w, 2);
        s.on_request_headers(&r, false);
        assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Continue);
        let r = cluster_not_found(r, "503");
        assert_eq!(s.on_response_headers(&r, true), Flow::Continue);
        assert!(r.replies().is_empty());
        assert_eq!(h.metric(metric::CLUSTER_NOT_FOUND), 0);
    }

    #[test]
    fn missing_cluster_is_named_not_an_empty_503() {
        let (h, w) = setup("{}", vec![ep(0, 0.1)]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w, 2);
        s.on_request_headers(&r, false);
        assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Continue);
        assert_eq!(r.header("x-kvroute-cluster").as_deref(), Some("c0"));
        // Only a 503 (or 404) response has its code details read.
        let r = cluster_not_found(r, "200");
        assert_eq!(s.on_response_headers(&r, true), Flow::Continue);
        assert!(r.replies().is_empty());
        assert!(!r.take_calls().iter().any(|(m, _)| *m == "property"));
        r.resp_headers
            .borrow_mut()
            .insert(":status".into(), "503".into());
        // A 503 with a body (a model server's own) has no header read at all; Envoy's
        // cluster_not_found reply has no body.
        assert_eq!(s.on_response_headers(&r, false), Flow::Continue);
        assert!(r.replies().is_empty());
        assert_eq!(r.take_calls(), [("metric_record", 1), ("now_ms", 1)]);
        assert_eq!(s.on_response_headers(&r, true), Flow::Pause);
        let rep = r.replies();
        assert_eq!(rep.len(), 1);
        assert_eq!(rep[0].status, 503);
        assert_eq!(
            String::from_utf8(rep[0].body.clone()).unwrap(),
            reply::cluster_not_found("c0").body
        );
        assert_eq!(h.metric(metric::CLUSTER_NOT_FOUND), 1);
        assert!(h
            .logs
            .borrow()
            .iter()
            .any(|l| l.contains("Envoy has no cluster `c0` (chosen for endpoint `pool/e0`)")));
        s.on_done(&r);
        // Releases reach the other workers (and the counter) with the tick.
        s.worker.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(h.metric(metric::RELEASED), 1);
    }

    #[test]
    fn fail_open_or_closed_without_a_snapshot() {
        let (h, w) = setup("{}", vec![]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w, 2);
        assert_eq!(s.on_request_headers(&r, true), Flow::Continue);
        assert_eq!(h.metric(metric::FAIL_OPEN), 1);
        let (h, w) = setup(r#"{"fail_open":false}"#, vec![]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w, 2);
        assert_eq!(s.on_request_headers(&r, true), Flow::Pause);
        assert_eq!(r.replies()[0].status, 503);
    }

    /// Pending prefill in the worker's own table (in memory: a first token changes it at
    /// once, and the other workers see it with the next publication).
    fn pending_prefill(w: &RefCell<Worker>) -> u64 {
        w.borrow()
            .inflight()
            .own()
            .totals(NOW)
            .values()
            .map(|v| v.prefill_tokens)
            .sum()
    }

    #[test]
    fn first_response_body_marks_prefill_done() {
        let (h, w) = setup("{}", vec![ep(0, 0.1)]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w, 2);
        s.on_request_headers(&r, false);
        s.on_request_body(&r, BODY.len(), true);
        // No prefix sent to this endpoint before: the whole estimated prompt is pending.
        let est = s.facts.prompt_tokens;
        assert!(est > 0);
        assert_eq!(pending_prefill(&s.worker), est);
        let kv = held(&h);
        r.resp_headers
            .borrow_mut()
            .insert("content-type".into(), "text/event-stream".into());
        s.on_response_headers(&r, false);
        // Headers alone do not end prefill (servers may send them before the first token).
        assert_eq!(pending_prefill(&s.worker), est);
        let chunk = b"data: {\"choices\":[]}\n\n".to_vec();
        *r.resp_chunk.borrow_mut() = chunk.clone();
        s.on_response_body(&r, chunk.len(), false);
        assert_eq!(pending_prefill(&s.worker), 0);
        assert_eq!(held(&h), kv, "the KV reservation stays until the end");
        s.on_response_body(&r, chunk.len(), false);
        assert_eq!(pending_prefill(&s.worker), 0);
        s.on_response_body(&r, 0, true);
        // Releases reach the other workers (and the counter) with the tick.
        s.worker.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(held(&h), 0);
        assert!(published(&h).is_empty());
    }

    #[test]
    fn sse_usage_across_chunks_calibrates_and_releases() {
        let (h, w) = setup("{}", vec![ep(0, 0.1)]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w.clone(), 2);
        s.on_request_headers(&r, false);
        s.on_request_body(&r, BODY.len(), true);
        let est = s.facts.prompt_tokens;
        assert!(est > 0);
        r.resp_headers
            .borrow_mut()
            .insert("content-type".into(), "text/event-stream".into());
        s.on_response_headers(&r, false);
        let stream = format!(
            "data: {{\"choices\":[]}}\n\ndata: {{\"usage\":{{\"prompt_tokens\":{},\"completion_tokens\":3}}}}\n\ndata: [DONE]\n\n",
            est * 2
        );
        let (a, b) = stream.as_bytes().split_at(40);
        *r.resp_chunk.borrow_mut() = a.to_vec();
        // The first event 250 ms after the decision: one TTFT sample for this endpoint.
        *h.now.borrow_mut() = NOW + 250;
        assert!(w.borrow().router().prefill_rates().is_empty());
        s.on_response_body(&r, a.len(), false);
        assert_eq!(w.borrow().router().prefill_rates().len(), 1);
        assert!(held(&h) > 0, "held until the response ends");
        *r.resp_chunk.borrow_mut() = b.to_vec();
        assert_eq!(
            *w.borrow().router().output_lengths(),
            kvroute_core::output_len::OutputLengths::new()
        );
        s.on_response_body(&r, b.len(), true);
        // Releases reach the other workers (and the counter) with the tick.
        s.worker.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(held(&h), 0);
        // usage.completion_tokens (3) was learned for (m, chat completions).
        let mut expected = kvroute_core::output_len::OutputLengths::new();
        expected.observe(
            "m",
            kvroute_core::analysis::ApiKind::ChatCompletions,
            est * 2,
            3,
        );
        assert_eq!(*w.borrow().router().output_lengths(), expected);
        let f = w.borrow().estimator().calibration(Some("m"));
        assert!((f - 1.1).abs() < 1e-9, "calibration {f}");
        assert_eq!(h.metric(metric::ESTIMATE_ERROR_PCT), 1);
        s.on_done(&r);
        assert_eq!(h.metric(metric::RELEASED), 1);
    }

    #[test]
    fn bodies_that_are_not_event_streams_give_no_first_token() {
        for (name, first, rest) in [
            ("gzip json", &b"\x1f\x8b\x08\x00\x00"[..], &b"\x00\x03"[..]),
            (
                "html error",
                b"<html><body>502 Bad",
                b" Gateway</body></html>",
            ),
            ("text error", b"upstream connect error or", b" disconnect"),
        ] {
            let (h, w) = setup("{}", vec![ep(0, 0.1)]);
            let (r, mut s, est) = routed_to_response(&h, &w);
            *h.now.borrow_mut() = NOW + 2_000;
            *r.resp_chunk.borrow_mut() = first.to_vec();
            s.on_response_body(&r, first.len(), false);
            assert!(
                w.borrow().router().prefill_rates().is_empty(),
                "{name}: learned a TTFT"
            );
            assert_eq!(pending_prefill(&w), est, "{name}: prefill ended early");
            *r.resp_chunk.borrow_mut() = rest.to_vec();
            s.on_response_body(&r, rest.len(), true);
            assert_eq!(h.metric(metric::ESTIMATE_ERROR_PCT), 0, "{name}");
            s.worker.borrow_mut().publish_inflight(&h, NOW);
            assert_eq!(held(&h), 0, "{name}");
        }
    }

    #[test]
    fn an_event_stream_split_inside_its_first_field_name_is_still_read() {
        let (h, w) = setup("{}", vec![ep(0, 0.1)]);
        let (r, mut s, est) = routed_to_response(&h, &w);
        let stream = format!(
            "data: {{\"usage\":{{\"prompt_tokens\":{est},\"completion_tokens\":3}}}}\n\ndata: [DONE]\n\n"
        );
        let (a, b) = stream.as_bytes().split_at(2);
        for (part, eos) in [(a, false), (b, true)] {
            *r.resp_chunk.borrow_mut() = part.to_vec();
            s.on_response_body(&r, part.len(), eos);
        }
        // "da" alone was undecided and held; the stream's usage was still read.
        assert_eq!(h.metric(metric::ESTIMATE_ERROR_PCT), 1);
        let mut expected = kvroute_core::output_len::OutputLengths::new();
        expected.observe(
            "m",
            kvroute_core::analysis::ApiKind::ChatCompletions,
            est,
            3,
        );
        assert_eq!(*w.borrow().router().output_lengths(), expected);
    }

    /// A chat request that asks for a stream (`stream: true`).
    const STREAMED: &[u8] =
        br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}]}"#;

    /// Empty model `m`'s `usage` bucket at the current time, so that the next response is
    /// not read for `usage` (its first chunk is only sniffed: `Resp::Unread`).
    fn drain_usage_bucket(w: &Rc<RefCell<Worker>>, h: &MockHost) {
        let facts = RequestFacts {
            model: Some("m".into()),
            ..RequestFacts::default()
        };
        let now = *h.now.borrow();
        while w.borrow_mut().sample_usage(&facts, now) {}
    }

    /// A streamed request (`body` to `path`) routed and its response headers seen, at
    /// `NOW`, its response read for `usage` or not (`read`): the request host, the stream,
    /// and the prefill learner as it would be after one TTFT sample of `ttft_s` from it.
    fn streamed_to_response(
        h: &MockHost,
        w: &Rc<RefCell<Worker>>,
        path: &str,
        body: &[u8],
        read: bool,
        ttft_s: f64,
    ) -> (MockHost, Stream, kvroute_core::prefill_rate::PrefillRates) {
        *h.now.borrow_mut() = NOW;
        if !read {
            drain_usage_bucket(w, h);
        }
        let r = request(h, path, body);
        let mut s = Stream::new(w.clone(), 2);
        s.on_request_headers(&r, false);
        s.on_request_body(&r, body.len(), true);
        s.on_response_headers(&r, false);
        assert_eq!(s.read_usage, read);
        assert!(s.facts.stream);
        let mut learned = w.borrow().router().prefill_rates().clone();
        assert!(learned.observe("pool/e0", s.facts.predicted_work_tokens, ttft_s));
        r.take_calls();
        (r, s, learned)
    }

    /// One response chunk `ms` after the decision: the host calls it made.
    fn chunk_at(
        r: &MockHost,
        s: &mut Stream,
        ms: u64,
        chunk: &[u8],
        eos: bool,
    ) -> Vec<(&'static str, u32)> {
        *r.now.borrow_mut() = NOW + ms;
        *r.resp_chunk.borrow_mut() = chunk.to_vec();
        s.on_response_body(r, chunk.len(), eos);
        r.take_calls()
    }

    /// Keep-alive comments sent while the prefill runs (LiteLLM's `: ping`, OpenRouter's
    /// `: OPENROUTER PROCESSING`) and events without data are no first token: the prefill
    /// stays pending and the TTFT sample is timed at the first `data` event, whether the
    /// response is read for `usage` or only sniffed.
    #[test]
    fn keep_alive_comments_are_no_first_token() {
        for read in [false, true] {
            let (h, w) = setup("{}", vec![ep(0, 0.1)]);
            let (r, mut s, learned) =
                streamed_to_response(&h, &w, "/v1/chat/completions", STREAMED, read, 0.75);
            let est = pending_prefill(&w);
            assert!(est > 0);
            let none = w.borrow().router().prefill_rates().clone();
            let calls = chunk_at(&r, &mut s, 100, b": ping\n\n", false);
            assert_eq!(calls, [("response_body", 1)], "read {read}");
            let calls = chunk_at(
                &r,
                &mut s,
                300,
                b":keep-alive\r\n\r\nevent: ping\n\n",
                false,
            );
            assert_eq!(calls, [("response_body", 1)], "read {read}");
            let calls = chunk_at(
                &r,
                &mut s,
                500,
                b"retry: 3000\n\n: OPENROUTER PROCESSING\n\n",
                false,
            );
            assert_eq!(calls, [("response_body", 1)], "read {read}");
            assert_eq!(pending_prefill(&w), est, "read {read}");
            assert_eq!(*w.borrow().router().prefill_rates(), none, "read {read}");
            // The first data event, 750 ms after the decision: the TTFT sample is 0.75 s.
            let calls = chunk_at(&r, &mut s, 750, b"data: {\"choices\":[]}\n\n", false);
            assert_eq!(calls, [("now_ms", 1), ("response_body", 1)], "read {read}");
            assert_eq!(pending_prefill(&w), 0, "read {read}");
            assert_eq!(*w.borrow().router().prefill_rates(), learned, "read {read}");
            let calls = chunk_at(&r, &mut s, 800, b"data: {\"choices\":[]}\n\n", false);
            let later: &[(&str, u32)] = if read { &[("response_body", 1)] } else { &[] };
            assert_eq!(calls, later, "read {read}: no call once the token showed");
            chunk_at(&r, &mut s, 900, b"data: [DONE]\n\n", true);
            s_flush(&w, &h);
            assert_eq!(held(&h), 0, "read {read}");
            assert_eq!(*w.borrow().router().prefill_rates(), learned, "read {read}");
        }
    }

    /// A stream that shows no token before its end (keep-alives, then the error event vLLM
    /// sends when the request fails during its prefill and `data: [DONE]`) gives no TTFT
    /// sample; its prefill stays pending until the end releases the reservation, and an
    /// unread stream's last chunk is not read.
    #[test]
    fn a_stream_without_a_token_releases_at_its_end() {
        for read in [false, true] {
            let (h, w) = setup("{}", vec![ep(0, 0.1)]);
            let (r, mut s, _) =
                streamed_to_response(&h, &w, "/v1/chat/completions", STREAMED, read, 1.0);
            let est = pending_prefill(&w);
            let none = w.borrow().router().prefill_rates().clone();
            let error = b"data: {\"error\": {\"message\": \"x\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n";
            for (i, chunk) in [&b": ping\n\n"[..], b":\n\n", error, b"data: [DONE]\n\n"]
                .into_iter()
                .enumerate()
            {
                let calls = chunk_at(&r, &mut s, 100 * (i as u64 + 1), chunk, false);
                assert_eq!(calls, [("response_body", 1)], "read {read}, chunk {i}");
            }
            assert_eq!(pending_prefill(&w), est, "read {read}");
            let calls = chunk_at(&r, &mut s, 500, b": ping\n\n", true);
            let last: &[(&str, u32)] = if read { &[("response_body", 1)] } else { &[] };
            assert_eq!(calls, last, "read {read}");
            assert_eq!(pending_prefill(&w), 0, "read {read}: released");
            s_flush(&w, &h);
            assert_eq!(held(&h), 0, "read {read}");
            assert_eq!(h.metric(metric::RELEASED), 1, "read {read}");
            assert_eq!(*w.borrow().router().prefill_rates(), none, "read {read}");
        }
    }

    /// The first token of an unread stream is looked for in its first
    /// `FIRST_TOKEN_MAX_CHUNKS` chunks (64): a token in the 64th is found; past them no
    /// chunk is read, and the prefill ends at the release, without a TTFT sample. A stream
    /// read for `usage` has every chunk read anyway: its token is found in any chunk.
    #[test]
    fn the_first_token_is_looked_for_in_at_most_sixty_four_chunks() {
        assert_eq!(FIRST_TOKEN_MAX_CHUNKS, 64);
        for (read, token_in, found) in [
            (false, 64, true),
            (false, 65, false),
            (true, 65, true),
            (true, 300, true),
        ] {
            let name = format!("read {read}, token in chunk {token_in}");
            let (h, w) = setup("{}", vec![ep(0, 0.1)]);
            let ttft_s = token_in as f64 / 10.0;
            let (r, mut s, learned) =
                streamed_to_response(&h, &w, "/v1/chat/completions", STREAMED, read, ttft_s);
            let est = pending_prefill(&w);
            let none = w.borrow().router().prefill_rates().clone();
            for i in 1..token_in {
                let calls = chunk_at(&r, &mut s, 100 * i, b": ping\n\n", false);
                assert_eq!(calls, [("response_body", 1)], "{name}: chunk {i}");
            }
            let calls = chunk_at(
                &r,
                &mut s,
                100 * token_in,
                b"data: {\"choices\":[]}\n\n",
                false,
            );
            if found {
                assert_eq!(calls, [("now_ms", 1), ("response_body", 1)], "{name}");
                assert_eq!(pending_prefill(&w), 0, "{name}");
                assert_eq!(*w.borrow().router().prefill_rates(), learned, "{name}");
            } else {
                assert_eq!(calls, [], "{name}: not read");
                assert_eq!(pending_prefill(&w), est, "{name}");
                assert_eq!(*w.borrow().router().prefill_rates(), none, "{name}");
            }
            let end = 100 * (token_in + 1);
            let last: &[(&str, u32)] = if read { &[("response_body", 1)] } else { &[] };
            let calls = chunk_at(&r, &mut s, end, b"data: [DONE]\n\n", true);
            assert_eq!(calls, last, "{name}");
            s_flush(&w, &h);
            assert_eq!(held(&h), 0, "{name}");
        }
    }

    /// A first data line split across chunks is the first token in the chunk where its
    /// value begins: after a comment, inside its field name (the next chunk), or inside its
    /// JSON value (this chunk).
    #[test]
    fn a_data_line_split_across_chunks_is_found_where_its_value_begins() {
        for (a, b, ttft_s) in [
            (&b": ping\n\nda"[..], &b"ta: {\"choices\":[]}\n\n"[..], 0.2),
            (b": ping\r\n\r\ndata: {\"ch", b"oices\":[]}\r\n\r\n", 0.1),
            (b"data:", b" {\"choices\":[]}\n\n", 0.2),
        ] {
            let name = String::from_utf8_lossy(a);
            let (h, w) = setup("{}", vec![ep(0, 0.1)]);
            let (r, mut s, learned) =
                streamed_to_response(&h, &w, "/v1/chat/completions", STREAMED, false, ttft_s);
            chunk_at(&r, &mut s, 100, a, false);
            chunk_at(&r, &mut s, 200, b, false);
            assert_eq!(pending_prefill(&w), 0, "{name}");
            assert_eq!(*w.borrow().router().prefill_rates(), learned, "{name}");
            assert_eq!(
                chunk_at(&r, &mut s, 300, b"data: {}\n\n", false),
                [],
                "{name}"
            );
        }
    }

    /// A Responses API stream opens with `response.created` and `response.in_progress`
    /// events, sent before generation begins (vLLM, OpenAI): no first token; the first
    /// output event is.
    #[test]
    fn responses_api_lifecycle_events_are_no_first_token() {
        let body = br#"{"model":"m","stream":true,"input":"hello there"}"#;
        for read in [false, true] {
            let (h, w) = setup("{}", vec![ep(0, 0.1)]);
            let (r, mut s, learned) =
                streamed_to_response(&h, &w, "/v1/responses", body, read, 0.9);
            let est = pending_prefill(&w);
            assert!(est > 0);
            let opening = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"status\":\"in_progress\"}}\n\nevent: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"response\":{\"status\":\"in_progress\"}}\n\n";
            assert_eq!(
                chunk_at(&r, &mut s, 5, opening, false),
                [("response_body", 1)]
            );
            assert_eq!(pending_prefill(&w), est, "read {read}");
            let token = b"event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\"}\n\n";
            chunk_at(&r, &mut s, 900, token, false);
            assert_eq!(pending_prefill(&w), 0, "read {read}");
            assert_eq!(*w.borrow().router().prefill_rates(), learned, "read {read}");
        }
    }

    /// What one routed request costs in host calls, callback by callback (a non-streamed
    /// JSON response in one chunk, the snapshot already decoded): every call crosses the
    /// Wasm boundary, and those that return data call back into the VM to allocate, so
    /// this is the filter's per-request cost outside its own code (`docs/overhead.md`).
    /// Counted in the steady state: the request before it has ended (its release is
    /// counted with this request's counters), and the worker published its in-flight table
    /// less than `inflight_share_ms` ago (this reservation waits for the next publication).
    #[test]
    fn a_routed_request_costs_fifteen_host_calls() {
        let (h, w) = setup("{}", vec![ep(0, 0.1), ep(1, 0.2)]);
        let plain = |h: &MockHost| {
            h.sibling()
                .with_header(":path", "/v1/chat/completions")
                .with_header(":method", "POST")
                .with_body(BODY)
        };
        // A first request reads the version and decodes the snapshot (two reads more); not
        // what is counted.
        let warm = plain(&h);
        let mut s = Stream::new(w.clone(), 1);
        s.on_request_headers(&warm, false);
        s.on_request_body(&warm, BODY.len(), true);
        s.on_done(&warm);
        let r = plain(&h);
        let mut s = Stream::new(w, 2);
        assert_eq!(s.on_request_headers(&r, false), Flow::Pause);
        assert_eq!(r.take_calls(), [("request_headers", 1)]);
        assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Continue);
        assert_eq!(
            r.take_calls(),
            [
                // decisions.policy, decisions.policy.hybrid, reserved, released (the
                // request before)
                ("metric_add", 4),
                // decision_us
                ("metric_record", 1),
                // start and end of the decision
                ("now_us", 2),
                ("request_body", 1),
                // the routing header
                ("set_request_header", 1),
                // the snapshot signal (an empty value: nothing allocated in the VM); the
                // in-flight reservation is this worker's own, in memory
                ("shared_get", 1),
            ]
        );
        s.on_response_headers(&r, false);
        // ttfb_ms; no header is read (the body tells SSE from JSON)
        assert_eq!(r.take_calls(), [("metric_record", 1), ("now_ms", 1)]);
        let reply = br#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}"#;
        *r.resp_chunk.borrow_mut() = reply.to_vec();
        s.on_response_body(&r, reply.len(), true);
        // estimate_error_pct; the release is in memory
        assert_eq!(r.take_calls(), [("metric_record", 1), ("response_body", 1)]);
        s.on_done(&r);
        assert_eq!(r.take_calls(), []);
        assert!(
            held(&h) > 0,
            "published for the other workers with the tick"
        );
        s.worker.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(held(&h), 0);
    }

    /// A routed request of `body` up to its response headers, on a fresh stream.
    fn to_response(h: &MockHost, w: &Rc<RefCell<Worker>>, body: &[u8]) -> (MockHost, Stream) {
        let r = request(h, "/v1/chat/completions", body);
        let mut s = Stream::new(w.clone(), 2);
        s.on_request_headers(&r, false);
        s.on_request_body(&r, body.len(), true);
        s.on_response_headers(&r, false);
        (r, s)
    }

    #[test]
    fn only_sampled_responses_are_read_for_usage() {
        use kvroute_core::usage_sample::BURST_READS;
        let (h, w) = setup(r#"{"usage_sample_ms":1000}"#, vec![ep(0, 0.1)]);
        let reply = br#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}"#;
        // A full bucket: the first responses of model `m` are all read.
        for _ in 0..BURST_READS {
            let (r, mut s) = to_response(&h, &w, BODY);
            *r.resp_chunk.borrow_mut() = reply.to_vec();
            s.on_response_body(&r, reply.len(), true);
            assert_eq!(
                r.take_calls().iter().find(|c| c.0 == "response_body"),
                Some(&("response_body", 1))
            );
        }
        let observed = h.metric(metric::ESTIMATE_ERROR_PCT);
        s_flush(&w, &h);
        assert_eq!(held(&h), 0);
        // Past it, within the interval: a streamed request's first chunk is read only to
        // tell an event stream from an error reply; being one, it ends the prefill and
        // gives a TTFT sample; later chunks are not read; the end releases.
        let streamed =
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}]}"#;
        let ttft_samples = || {
            w.borrow()
                .router()
                .prefill_rates()
                .estimate("pool/e0")
                .observations
        };
        let samples = ttft_samples();
        let (r, mut s) = to_response(&h, &w, streamed);
        assert!(pending_prefill(&w) > 0);
        r.take_calls();
        *h.now.borrow_mut() += 200;
        *r.resp_chunk.borrow_mut() = b"data: {\"choices\":[]}\n\n".to_vec();
        s.on_response_body(&r, 24, false);
        assert_eq!(pending_prefill(&w), 0);
        assert_eq!(ttft_samples(), samples + 1);
        // the first chunk and the TTFT clock (prefill done is in memory)
        assert_eq!(r.take_calls(), [("now_ms", 1), ("response_body", 1)]);
        s.on_response_body(&r, 24, false);
        s.on_response_body(&r, 0, true);
        assert_eq!(
            r.take_calls(),
            [],
            "later chunks and the end cost no host call"
        );
        s_flush(&w, &h);
        assert_eq!(held(&h), 0);
        // An error reply to a streamed request: its first chunk is sniffed as JSON, so it
        // is no first token (no TTFT sample, the prefill stays until the release).
        let (r, mut s) = to_response(&h, &w, streamed);
        let pending = pending_prefill(&w);
        r.take_calls();
        *h.now.borrow_mut() += 5;
        let error = br#"{"error":{"message":"too long","type":"BadRequestError","code":400}}"#;
        *r.resp_chunk.borrow_mut() = error.to_vec();
        s.on_response_body(&r, error.len(), false);
        assert_eq!(pending_prefill(&w), pending);
        s.on_response_body(&r, 0, true);
        assert_eq!(ttft_samples(), samples + 1);
        assert_eq!(r.take_calls(), [("response_body", 1)]);
        s_flush(&w, &h);
        assert_eq!(held(&h), 0);
        // A non-streamed one: its (only) chunk is not read and is not a first token.
        let (r, mut s) = to_response(&h, &w, BODY);
        let pending = pending_prefill(&w);
        assert!(pending > 0);
        r.take_calls();
        s.on_response_body(&r, reply.len(), false);
        assert_eq!(pending_prefill(&w), pending);
        s.on_response_body(&r, 0, true);
        assert_eq!(r.take_calls(), []);
        s_flush(&w, &h);
        assert_eq!(held(&h), 0);
        assert_eq!(
            h.metric(metric::ESTIMATE_ERROR_PCT),
            observed,
            "no usage was read"
        );
        // One interval later, the next response is read again.
        *h.now.borrow_mut() += 1_000;
        let (r, mut s) = to_response(&h, &w, BODY);
        *r.resp_chunk.borrow_mut() = reply.to_vec();
        s.on_response_body(&r, reply.len(), true);
        assert!(r.take_calls().contains(&("response_body", 1)));
        assert!(h.metric(metric::ESTIMATE_ERROR_PCT) > observed);
    }

    fn s_flush(w: &Rc<RefCell<Worker>>, h: &MockHost) {
        w.borrow_mut().publish_inflight(h, NOW);
    }

    #[test]
    fn json_usage_is_read_from_a_non_streamed_body() {
        let (h, w) = setup("{}", vec![ep(0, 0.1)]);
        let (r, mut s, est) = routed_to_response(&h, &w);
        let body =
            format!(r#"{{"choices":[],"usage":{{"prompt_tokens":{est},"completion_tokens":1}}}}"#);
        // Two chunks, 250 ms after the decision: the first bytes of a JSON body come after
        // the whole generation, so they are no TTFT sample; its usage still counts.
        let (a, b) = body.as_bytes().split_at(10);
        *h.now.borrow_mut() = NOW + 250;
        *r.resp_chunk.borrow_mut() = a.to_vec();
        s.on_response_body(&r, a.len(), false);
        *r.resp_chunk.borrow_mut() = b.to_vec();
        s.on_response_body(&r, b.len(), true);
        // Releases reach the other workers (and the counter) with the tick.
        s.worker.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(held(&h), 0);
        assert!((w.borrow().estimator().calibration(Some("m")) - 1.0).abs() < 1e-9);
        assert!(w.borrow().router().prefill_rates().is_empty());
        assert_ne!(
            *w.borrow().router().output_lengths(),
            kvroute_core::output_len::OutputLengths::new()
        );
    }

    /// `usage.completion_tokens` counts the tokens of every choice, while the output learner
    /// keeps tokens per choice (the KV demand multiplies its prediction by `n`), so a
    /// response to `n` choices is learned as `completion_tokens / n` per choice, exactly as
    /// the same number of single-choice responses of that length would be.
    #[test]
    fn output_of_n_choices_is_learned_per_choice() {
        use kvroute_core::analysis::ApiKind;
        use kvroute_core::output_len::OutputLengths;
        let (h, w) = setup("{}", vec![ep(0, 0.1)]);
        let body = br#"{"model":"m","n":4,"messages":[{"role":"user","content":"hello there"}]}"#;
        let reply = br#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":400}}"#;
        let mut expected = OutputLengths::new();
        for _ in 0..25 {
            let (r, mut s) = to_response(&h, &w, body);
            *r.resp_chunk.borrow_mut() = reply.to_vec();
            s.on_response_body(&r, reply.len(), true);
            expected.observe("m", ApiKind::ChatCompletions, 9, 100);
        }
        assert_eq!(*w.borrow().router().output_lengths(), expected);
    }

    #[test]
    fn saturated_requests_queue_then_resume_or_time_out() {
        let cfg = r#"{"picker":{"policy":"least_kv","min_kv_headroom":0.5},
            "admission":{"enabled":true,"max_queue":4,"timeout_ms":1000,"tick_ms":10}}"#;
        let (h, w) = setup(cfg, vec![ep(0, 0.95), ep(1, 0.97)]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w.clone(), 7);
        s.on_request_headers(&r, false);
        assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Pause);
        assert!(r.replies().is_empty());
        assert_eq!(h.metric(metric::QUEUED), 1);
        assert_eq!(w.borrow_mut().tick(&h), 0, "still saturated");
        // Re-decided in place: the head keeps its path and body, and its bytes.
        assert_eq!(
            w.borrow().admission.peek(),
            Some(&Parked {
                context_id: 7,
                path: "/v1/chat/completions".into(),
                body: BODY.to_vec(),
            })
        );
        assert_eq!(
            w.borrow().admission.held_bytes(),
            "/v1/chat/completions".len() + BODY.len()
        );
        // Capacity frees up: the next tick resumes the request on e1.
        shared::publish_snapshot(
            &h,
            &Snapshot::new(2, NOW, vec![ep(0, 0.95), ep(1, 0.1)]).encode(),
        )
        .unwrap();
        assert_eq!(w.borrow_mut().tick(&h), 1);
        assert_eq!(
            h.ctx_events.borrow().clone(),
            vec![(7, "resume".to_string())]
        );
        assert!(held(&h) > 0);
        s.on_response_headers(&r, false);
        s.on_done(&r);
        // Releases reach the other workers (and the counter) with the tick.
        s.worker.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(held(&h), 0);

        // A second one times out with a 429 and retry-after.
        shared::publish_snapshot(&h, &Snapshot::new(3, NOW, vec![ep(0, 0.95)]).encode()).unwrap();
        let r2 = request(&h, "/v1/chat/completions", BODY);
        let mut s2 = Stream::new(w.clone(), 8);
        s2.on_request_headers(&r2, false);
        assert_eq!(s2.on_request_body(&r2, BODY.len(), true), Flow::Pause);
        *h.now.borrow_mut() = NOW + 1000;
        w.borrow_mut().tick(&h);
        let replies = h.replies();
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].status, 429);
        assert!(replies[0]
            .headers
            .contains(&("retry-after".into(), "1".into())));
        assert_eq!(w.borrow().admission.len(), 0);
    }

    /// A chat request on stream 7 parked in the admission queue (`cfg` holds admission on
    /// and a headroom both endpoints, at 95 % and 97 % KV usage, lack).
    fn parked(cfg: &str) -> (MockHost, Rc<RefCell<Worker>>, MockHost, Stream) {
        let (h, w) = setup(cfg, vec![ep(0, 0.95), ep(1, 0.97)]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w.clone(), 7);
        s.on_request_headers(&r, false);
        assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Pause);
        (h, w, r, s)
    }

    /// Endpoint e1 frees up (10 % KV usage) and the tick resumes the parked request there.
    fn resume_on_e1(h: &MockHost, w: &Rc<RefCell<Worker>>) {
        shared::publish_snapshot(
            h,
            &Snapshot::new(2, NOW, vec![ep(0, 0.95), ep(1, 0.1)]).encode(),
        )
        .unwrap();
        assert_eq!(w.borrow_mut().tick(h), 1);
    }

    /// A request held while saturated and resumed by the tick carries its real decision
    /// reason, as one decided at once does: the tick sets it on the upstream request and as
    /// the decision record, and the stream adopts it for the response's
    /// `x-kvroute-decision`.
    #[test]
    fn a_resumed_request_carries_its_decision_reason() {
        let cfg = r#"{"debug_header":true,"decision_record":true,
            "picker":{"policy":"least_kv","min_kv_headroom":0.5},"admission":{"enabled":true}}"#;
        let (h, w, r, mut s) = parked(cfg);
        assert_eq!(w.borrow_mut().tick(&h), 0, "still saturated");
        assert_eq!(h.header(DECISION_HEADER), None);
        resume_on_e1(&h, &w);
        // The tick decided on the held stream's context (the mock's root host here).
        let reason = h.header(DECISION_HEADER).unwrap();
        assert_eq!(
            reason.split_once(";top=").map(|(head, _)| head),
            Some("policy:least_kv;endpoint=pool/e1")
        );
        assert_eq!(h.property(&[DECISION_PROPERTY]), Some(reason.clone()));
        assert_eq!(s.on_response_headers(&r, false), Flow::Continue);
        assert_eq!(r.response_header(DECISION_HEADER), Some(reason));
        s.on_done(&r);
    }

    /// Endpoint mode: a request resumed from the admission queue has its upstream checked
    /// at its response, as one decided at once does (a misroute was uncounted).
    #[test]
    fn a_resumed_request_has_its_upstream_checked() {
        let cfg = r#"{"mode":"endpoint",
            "picker":{"policy":"least_kv","min_kv_headroom":0.5},"admission":{"enabled":true}}"#;
        let (h, w, r, mut s) = parked(cfg);
        resume_on_e1(&h, &w);
        let r = r.with_property("upstream.address", "10.0.0.9:8000");
        assert_eq!(s.on_response_headers(&r, false), Flow::Continue);
        assert_eq!(h.metric(metric::UPSTREAM_MISMATCH), 1);
        s.on_done(&r);
    }

    /// A reservation its stream outlives (`reservation_ttl_ms`) is counted as expired when
    /// dropped, and its stream's end releases nothing: reserved = released + expired.
    #[test]
    fn a_reservation_outlived_by_its_stream_is_counted_expired() {
        let (h, w) = setup(r#"{"reservation_ttl_ms":500}"#, vec![ep(0, 0.1)]);
        w.borrow_mut().set_worker_number(1);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w.clone(), 2);
        s.on_request_headers(&r, false);
        assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Continue);
        assert_eq!(h.metric(metric::RESERVED), 1);
        w.borrow_mut().publish_inflight(&h, NOW + 10_000);
        assert_eq!(h.metric(metric::EXPIRED), 1);
        s.on_done(&r);
        w.borrow_mut().publish_inflight(&h, NOW + 30_000);
        assert_eq!(h.metric(metric::RELEASED), 0);
    }

    /// A held request whose body does not parse is decided by load alone, again at every
    /// tick: its parse error and load-only basis are counted once, at its first decision,
    /// not once per tick.
    #[test]
    fn a_held_unparsable_body_is_counted_once() {
        let cfg = r#"{"picker":{"policy":"least_kv","min_kv_headroom":0.5},
            "admission":{"enabled":true,"timeout_ms":5000,"tick_ms":10}}"#;
        let (h, w) = setup(cfg, vec![ep(0, 0.95), ep(1, 0.97)]);
        let body = b"{not json";
        let r = request(&h, "/v1/chat/completions", body);
        let mut s = Stream::new(w.clone(), 7);
        s.on_request_headers(&r, false);
        assert_eq!(s.on_request_body(&r, body.len(), true), Flow::Pause);
        assert_eq!(h.metric(metric::QUEUED), 1);
        for _ in 0..50 {
            assert_eq!(w.borrow_mut().tick(&h), 0, "still saturated");
        }
        assert_eq!(h.metric(metric::PARSE_ERRORS), 1);
        assert_eq!(h.metric(metric::DECISIONS_LOAD_ONLY), 1);
        assert_eq!(w.borrow().admission.len(), 1);
    }

    /// `admission.max_queue_bytes` bounds the bytes the queue copies (body + path): with
    /// 1000 bytes, one 580-byte body on `/v1/chat/completions` (20 bytes) holds 600, a
    /// second one would make 1200 and is answered 429 at once, while an 82-byte one still
    /// fits (702). The tick then serves both held ones and the count returns to 0.
    #[test]
    fn queue_byte_bound_refuses_a_large_body_but_holds_a_small_one() {
        let cfg = r#"{"picker":{"policy":"least_kv","min_kv_headroom":0.5},
            "admission":{"enabled":true,"max_queue":4,"max_queue_bytes":1000,"timeout_ms":1000}}"#;
        let (h, w) = setup(cfg, vec![ep(0, 0.95)]);
        let large = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}],"max_tokens":10}}"#,
            "x".repeat(509)
        );
        assert_eq!((large.len(), BODY.len()), (580, 82));
        // (requests, bytes) held.
        let queued = |w: &Rc<RefCell<Worker>>| {
            let w = w.borrow();
            (w.admission.len(), w.admission.held_bytes())
        };
        let park = |ctx: u32, body: &[u8]| {
            let r = request(&h, "/v1/chat/completions", body);
            let mut s = Stream::new(w.clone(), ctx);
            assert_eq!(s.on_request_headers(&r, false), Flow::Pause);
            assert_eq!(s.on_request_body(&r, body.len(), true), Flow::Pause);
            (r, s)
        };

        let (r1, _s1) = park(10, large.as_bytes());
        assert_eq!(queued(&w), (1, 600));
        assert_eq!(r1.replies().len(), 0);

        let (r2, _s2) = park(11, large.as_bytes());
        let replies = r2.replies();
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].status, 429);
        assert!(replies[0]
            .headers
            .contains(&("retry-after".into(), "1".into())));
        assert_eq!(
            String::from_utf8(replies[0].body.clone()).unwrap(),
            reply::saturated(1).body
        );
        assert_eq!(
            h.logs.borrow().last().map(String::as_str),
            Some(
                "kvroute: saturated, not held: admission queue is full \
                 (600 of 1000 bytes held, 600 more do not fit)"
            )
        );
        assert_eq!(queued(&w), (1, 600));

        let (r3, _s3) = park(12, BODY);
        assert_eq!(r3.replies().len(), 0, "the small one is held");
        assert_eq!(queued(&w), (2, 702));
        assert_eq!(h.metric(metric::QUEUED), 2);
        assert_eq!(h.metric(metric::REJECTED), 1);
        assert_eq!(h.metric(metric::QUEUE_LENGTH), 2);

        // Capacity frees: the tick serves both, the smaller job first.
        shared::publish_snapshot(&h, &Snapshot::new(2, NOW, vec![ep(0, 0.1)]).encode()).unwrap();
        assert_eq!(w.borrow_mut().tick(&h), 2);
        assert_eq!(
            h.ctx_events.borrow().clone(),
            vec![(12, "resume".to_string()), (10, "resume".to_string())]
        );
        assert_eq!(queued(&w), (0, 0));
        // Room again for the large body.
        shared::publish_snapshot(&h, &Snapshot::new(3, NOW, vec![ep(0, 0.95)]).encode()).unwrap();
        let (r4, _s4) = park(13, large.as_bytes());
        assert_eq!(r4.replies().len(), 0);
        assert_eq!(queued(&w), (1, 600));
        assert_eq!(h.metric(metric::QUEUED), 3);
    }

    #[test]
    fn saturated_without_admission_is_an_immediate_429() {
        let cfg = r#"{"picker":{"policy":"least_kv","min_kv_headroom":0.5}}"#;
        let (h, w) = setup(cfg, vec![ep(0, 0.95)]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w, 7);
        s.on_request_headers(&r, false);
        assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Pause);
        let rep = r.replies();
        assert_eq!(rep[0].status, 429);
        assert_eq!(
            String::from_utf8(rep[0].body.clone()).unwrap(),
            reply::saturated(1).body
        );
    }

    /// A request whose KV demand exceeds every endpoint's whole KV capacity can never fit,
    /// so "saturated, retry later" would be a lie: it is routed by load (the model server
    /// gives its own answer, e.g. vLLM's 400) with its reservation capped at the capacity.
    #[test]
    fn demand_larger_than_any_capacity_is_routed_not_429() {
        // Idle fleet (usage 0), capacity 100,000 tokens; n × max_tokens = 4 × 60,000.
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":60000,"n":4}"#;
        for cfg in ["{}", r#"{"admission":{"enabled":true}}"#] {
            let (h, w) = setup(cfg, vec![ep(0, 0.0), ep(1, 0.0)]);
            let r = request(&h, "/v1/chat/completions", body);
            let mut s = Stream::new(w.clone(), 7);
            s.on_request_headers(&r, false);
            assert_eq!(
                s.on_request_body(&r, body.len(), true),
                Flow::Continue,
                "{cfg}"
            );
            assert!(r.replies().is_empty(), "{cfg}: {:?}", r.replies());
            assert_eq!(w.borrow().admission.len(), 0, "{cfg}");
            let routed = r.header("x-kvroute-cluster");
            assert!(
                routed.as_deref() == Some("c0") || routed.as_deref() == Some("c1"),
                "{cfg}: {routed:?}"
            );
            assert_eq!(
                held(&h),
                100_000,
                "{cfg}: reservation capped at the capacity"
            );
            assert_eq!(h.metric(metric::DEMAND_OVER_CAPACITY), 1, "{cfg}");
            s.on_response_headers(&r, false);
            s.on_done(&r);
            // Releases reach the other workers (and the counter) with the tick.
            s.worker.borrow_mut().publish_inflight(&h, NOW);
            assert_eq!(held(&h), 0, "{cfg}");
        }
    }

    /// HTTP/2 (or HTTP/1 with trailers enabled): the last data frame is not end of stream;
    /// trailers end the request. The decision must happen there, on the buffered body.
    #[test]
    fn request_ending_with_trailers_is_decided_on_its_body() {
        let (h, w) = setup(
            r#"{"picker":{"policy":"least_kv"}}"#,
            vec![ep(0, 0.9), ep(1, 0.1)],
        );
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w, 2);
        assert_eq!(s.on_request_headers(&r, false), Flow::Pause);
        assert_eq!(s.on_request_body(&r, BODY.len(), false), Flow::Pause);
        assert_eq!(s.on_request_trailers(&r), Flow::Continue);
        assert_eq!(r.header("x-kvroute-cluster").as_deref(), Some("c1"));
        assert_eq!(h.metric(metric::RESERVED), 1);
        assert_eq!(
            h.metric(metric::DECISIONS_LOAD_ONLY),
            0,
            "the body was read"
        );
        s.on_done(&r);
        // Releases reach the other workers (and the counter) with the tick.
        s.worker.borrow_mut().publish_inflight(&h, NOW);
        assert_eq!(held(&h), 0);
    }
    /// A saturated request whose body the filter does not read (over `max_body_bytes`,
    /// buffered past it or declared; `Content-Encoding`; an upgrade) is never held, even
    /// with admission on: its paused stream would make Envoy buffer the body until
    /// `per_connection_buffer_limit_bytes`, then answer its own text 413. It gets the 429
    /// of a full queue at once, with `retry-after`, counted as rejected; the rest of its
    /// body stays paused (answered). A request with no body has nothing to buffer and is
    /// still held, then resumed when capacity frees.
    #[test]
    fn saturated_requests_whose_body_is_not_read_are_answered_not_held() {
        let cfg = r#"{"max_body_bytes":16,"picker":{"policy":"least_kv","min_kv_headroom":0.5},
            "admission":{"enabled":true}}"#;
        let (h, w) = setup(cfg, vec![ep(0, 0.95)]);
        let answered_429 = |r: &MockHost, what: &str| {
            let replies = r.replies();
            assert_eq!(replies.len(), 1, "{what}");
            assert_eq!(replies[0].status, 429, "{what}");
            assert!(
                replies[0]
                    .headers
                    .contains(&("retry-after".into(), "1".into())),
                "{what}"
            );
            assert_eq!(
                String::from_utf8(replies[0].body.clone()).unwrap(),
                reply::saturated(1).body,
                "{what}"
            );
        };
        // Buffered past `max_body_bytes`: decided by load, answered, and kept paused.
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w.clone(), 9);
        assert_eq!(s.on_request_headers(&r, false), Flow::Pause);
        assert_eq!(s.on_request_body(&r, 20, false), Flow::Pause);
        answered_429(&r, "buffered past max_body_bytes");
        assert_eq!(s.on_request_body(&r, 40, false), Flow::Pause);
        assert_eq!(s.on_request_trailers(&r), Flow::Pause);
        s.on_done(&r);
        // Decided at the headers, with a body that follows.
        for (ctx, (k, v)) in [
            (10, ("content-length", "101")),
            (11, ("content-encoding", "gzip")),
            (12, ("upgrade", "websocket")),
        ] {
            let r = request(&h, "/v1/chat/completions", BODY).with_header(k, v);
            let mut s = Stream::new(w.clone(), ctx);
            assert_eq!(s.on_request_headers(&r, false), Flow::Pause, "{k}");
            answered_429(&r, k);
            s.on_done(&r);
        }
        assert_eq!(w.borrow().admission.len(), 0);
        assert_eq!(h.metric(metric::QUEUED), 0);
        assert_eq!(h.metric(metric::REJECTED), 4);
        assert_eq!(h.metric(metric::QUEUE_LENGTH), 0);
        assert_eq!(
            h.logs.borrow().last().map(String::as_str),
            Some("kvroute: saturated, not held: its body is not read (Envoy would buffer it)")
        );
        // No body at all (end of stream at the headers): held, its path only, then resumed.
        let r = request(&h, "/v1/chat/completions", b"");
        let mut s = Stream::new(w.clone(), 13);
        assert_eq!(s.on_request_headers(&r, true), Flow::Pause);
        assert!(r.replies().is_empty());
        assert_eq!(
            (
                w.borrow().admission.len(),
                w.borrow().admission.held_bytes()
            ),
            (1, "/v1/chat/completions".len())
        );
        assert_eq!(h.metric(metric::QUEUED), 1);
        shared::publish_snapshot(&h, &Snapshot::new(2, NOW, vec![ep(0, 0.1)]).encode()).unwrap();
        assert_eq!(w.borrow_mut().tick(&h), 1);
        assert_eq!(
            h.ctx_events.borrow().clone(),
            vec![(13, "resume".to_string())]
        );
        assert_eq!(h.metric(metric::RESERVED), 1);
        s.on_response_headers(&r, false);
        s.on_done(&r);
        s_flush(&w, &h);
        assert_eq!(h.metric(metric::RELEASED), 1);
        assert_eq!(h.metric(metric::REJECTED), 4);
    }

    #[test]
    fn client_abort_while_queued_leaves_the_queue() {
        let cfg = r#"{"picker":{"policy":"least_kv","min_kv_headroom":0.5},"admission":{"enabled":true}}"#;
        let (h, w) = setup(cfg, vec![ep(0, 0.95)]);
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w.clone(), 9);
        s.on_request_headers(&r, false);
        s.on_request_body(&r, BODY.len(), true);
        assert_eq!(w.borrow().admission.len(), 1);
        s.on_done(&r);
        assert_eq!(w.borrow().admission.len(), 0);
        assert_eq!(
            w.borrow().admission.held_bytes(),
            0,
            "its bytes left with it"
        );
        assert_eq!(held(&h), 0);
    }

    /// An event stream that opens with a byte order mark (the SSE spec strips one), cut
    /// into 1-byte chunks: the mark and `data` are held undecided, and the first token is
    /// the chunk where its value begins (byte 9, 100 ms after the decision).
    #[test]
    fn a_stream_opening_with_a_byte_order_mark_gives_its_first_token() {
        let stream = b"\xEF\xBB\xBFdata: {\"choices\":[]}\n\n";
        // Decided at the `c` of `{"choices"` (where it stops being a prefix of `{"error"`).
        let at = stream.iter().position(|&b| b == b'{').unwrap() + 2;
        assert_eq!(at, 11);
        for read in [false, true] {
            let (h, w) = setup("{}", vec![ep(0, 0.1)]);
            let (r, mut s, learned) =
                streamed_to_response(&h, &w, "/v1/chat/completions", STREAMED, read, 0.12);
            let est = pending_prefill(&w);
            // Byte i arrives at 10 (i + 1) ms: the deciding one, the 12th, at 120 ms.
            for (i, b) in stream.iter().enumerate() {
                let calls = chunk_at(&r, &mut s, 10 * (i as u64 + 1), &[*b], false);
                if i < at {
                    assert_eq!(calls, [("response_body", 1)], "read {read}, byte {i}");
                    assert_eq!(pending_prefill(&w), est, "read {read}, byte {i}");
                }
            }
            assert_eq!(pending_prefill(&w), 0, "read {read}");
            assert_eq!(*w.borrow().router().prefill_rates(), learned, "read {read}");
            chunk_at(&r, &mut s, 500, b"data: [DONE]\n\n", true);
            s_flush(&w, &h);
            assert_eq!(held(&h), 0, "read {read}");
            assert_eq!(h.metric(metric::RELEASED), 1, "read {read}");
        }
    }

    /// A stream whose first token comes in the chunk that ends it (the whole stream in one
    /// chunk, or keep-alives then the rest at once): no TTFT sample (the prefill and the
    /// generation are over together), the reservation released once, a later `on_done`
    /// releases nothing more.
    #[test]
    fn a_token_in_the_chunk_that_ends_the_stream_gives_no_ttft_and_releases_once() {
        let last = b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        for read in [false, true] {
            for keep_alives in [0, 3] {
                let name = format!("read {read}, {keep_alives} keep-alives");
                let (h, w) = setup("{}", vec![ep(0, 0.1)]);
                let (r, mut s, _) =
                    streamed_to_response(&h, &w, "/v1/chat/completions", STREAMED, read, 1.0);
                let none = w.borrow().router().prefill_rates().clone();
                for i in 0..keep_alives {
                    chunk_at(&r, &mut s, 100 * (i + 1), b": ping\n\n", false);
                }
                chunk_at(&r, &mut s, 900, last, true);
                assert_eq!(*w.borrow().router().prefill_rates(), none, "{name}");
                assert_eq!(pending_prefill(&w), 0, "{name}");
                s.on_done(&r);
                s_flush(&w, &h);
                assert_eq!(held(&h), 0, "{name}");
                assert_eq!(h.metric(metric::RELEASED), 1, "{name}");
            }
        }
    }

    /// The client goes away (or the upstream resets) while the first token is awaited:
    /// `on_done` releases the reservation, its pending prefill with it, exactly once; a
    /// chunk delivered after it finds nothing held and learns nothing.
    #[test]
    fn abort_while_the_first_token_is_awaited_releases_once() {
        for read in [false, true] {
            let (h, w) = setup("{}", vec![ep(0, 0.1)]);
            let (r, mut s, _) =
                streamed_to_response(&h, &w, "/v1/chat/completions", STREAMED, read, 1.0);
            let none = w.borrow().router().prefill_rates().clone();
            chunk_at(&r, &mut s, 100, b": ping\n\n", false);
            assert!(pending_prefill(&w) > 0);
            s.on_done(&r);
            assert_eq!(pending_prefill(&w), 0, "read {read}");
            chunk_at(&r, &mut s, 200, b"data: {}\n\n", false);
            chunk_at(&r, &mut s, 300, b"data: [DONE]\n\n", true);
            s.on_done(&r);
            s_flush(&w, &h);
            assert_eq!(held(&h), 0, "read {read}");
            assert_eq!(h.metric(metric::RELEASED), 1, "read {read}");
            assert_eq!(*w.borrow().router().prefill_rates(), none, "read {read}");
        }
    }

    /// `admission.max_queue_bytes` counts the path with the body, and a request that
    /// fills it to the byte is held: `/v1/chat/completions` (20) + `BODY` (82) = 102
    /// bytes fits a bound of 102, not of 101; a bound smaller than the path refuses even a
    /// request held without its body.
    #[test]
    fn queue_byte_bound_is_inclusive_and_counts_the_path() {
        let cfg = |bytes: usize| {
            format!(
                r#"{{"picker":{{"policy":"least_kv","min_kv_headroom":0.5}},
                "admission":{{"enabled":true,"max_queue_bytes":{bytes}}}}}"#
            )
        };
        for (bytes, held_first) in [(102, true), (101, false)] {
            let (h, w) = setup(&cfg(bytes), vec![ep(0, 0.95)]);
            for ctx in [10, 11] {
                let r = request(&h, "/v1/chat/completions", BODY);
                let mut s = Stream::new(w.clone(), ctx);
                s.on_request_headers(&r, false);
                assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Pause);
                let held = ctx == 10 && held_first;
                assert_eq!(r.replies().len(), usize::from(!held), "{bytes}: ctx {ctx}");
            }
            let want = if held_first { (1, 102) } else { (0, 0) };
            let w = w.borrow();
            assert_eq!(
                (w.admission.len(), w.admission.held_bytes()),
                want,
                "{bytes}"
            );
        }
        let (h, w) = setup(&cfg(10), vec![ep(0, 0.95)]);
        let r = request(&h, "/v1/chat/completions", b"");
        let mut s = Stream::new(w.clone(), 12);
        assert_eq!(s.on_request_headers(&r, true), Flow::Pause);
        assert_eq!(r.replies()[0].status, 429);
        assert_eq!(
            h.logs.borrow().last().map(String::as_str),
            Some(
                "kvroute: saturated, not held: admission queue is full \
                 (0 of 10 bytes held, 20 more do not fit)"
            )
        );
        assert_eq!(w.borrow().admission.len(), 0);
    }

    /// The tick re-decides the head in place, moving its body out and back: after many
    /// ticks that find no capacity, both parked requests still hold their bodies and
    /// bytes. When the head's context is gone (the tick cannot make it effective), it is
    /// dropped with its bytes, and the next one is resumed, decided on its body, not by
    /// load alone.
    #[test]
    fn parked_bodies_survive_many_ticks_and_a_gone_head_is_dropped() {
        let cfg = r#"{"picker":{"policy":"least_kv","min_kv_headroom":0.5},
            "admission":{"enabled":true,"timeout_ms":60000}}"#;
        let (h, w) = setup(cfg, vec![ep(0, 0.95)]);
        let mut parked = Vec::new();
        for ctx in [10, 11] {
            let r = request(&h, "/v1/chat/completions", BODY);
            let mut s = Stream::new(w.clone(), ctx);
            s.on_request_headers(&r, false);
            assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Pause);
            parked.push((r, s));
        }
        let bytes = "/v1/chat/completions".len() + BODY.len();
        for tick in 0..50 {
            *h.now.borrow_mut() = NOW + 10 * tick;
            assert_eq!(w.borrow_mut().tick(&h), 0);
        }
        {
            let w = w.borrow();
            assert_eq!(
                (w.admission.len(), w.admission.held_bytes()),
                (2, 2 * bytes)
            );
            let head = w.admission.peek().unwrap();
            assert_eq!((head.context_id, head.body.as_slice()), (10, BODY));
        }
        assert_eq!(h.metric(metric::DECISIONS_LOAD_ONLY), 0);
        h.gone.borrow_mut().insert(10);
        shared::publish_snapshot(&h, &Snapshot::new(2, NOW, vec![ep(0, 0.1)]).encode()).unwrap();
        assert_eq!(w.borrow_mut().tick(&h), 1);
        assert_eq!(
            h.ctx_events.borrow().clone(),
            vec![(11, "resume".to_string())]
        );
        {
            let w = w.borrow();
            assert_eq!((w.admission.len(), w.admission.held_bytes()), (0, 0));
            assert_eq!(w.resumed.keys().copied().collect::<Vec<_>>(), [11]);
        }
        assert_eq!(
            h.metric(metric::DECISIONS_LOAD_ONLY),
            0,
            "decided on its body"
        );
        let (r11, s11) = &mut parked[1];
        s11.on_response_headers(r11, false);
        assert_eq!(s11.facts.model.as_deref(), Some("m"));
        assert!(s11.facts.prompt_tokens > 0);
        for (r, s) in &mut parked {
            s.on_done(r);
        }
        s_flush(&w, &h);
        assert_eq!(held(&h), 0);
        assert_eq!(h.metric(metric::RELEASED), 1);
    }
    /// A parked request whose re-decision in the tick fails open (its snapshot became
    /// unreadable) follows `fail_open` as a request decided at once does: resumed unrouted,
    /// its stream told it left the queue, and its response marked `fail_open` with
    /// `debug_header`; with `fail_open: false` answered 503. Before, it was resumed
    /// whatever `fail_open` said, and its stream, never told it left the queue, paused the
    /// rest of its body for good.
    #[test]
    fn a_parked_request_that_fails_open_in_the_tick_follows_fail_open() {
        for fail_open in [true, false] {
            let cfg = format!(
                r#"{{"debug_header":true,"fail_open":{fail_open},
                "picker":{{"policy":"least_kv","min_kv_headroom":0.5}},"admission":{{"enabled":true}}}}"#
            );
            let (h, w) = setup(&cfg, vec![ep(0, 0.95)]);
            let r = request(&h, "/v1/chat/completions", BODY);
            let mut s = Stream::new(w.clone(), 9);
            s.on_request_headers(&r, false);
            assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Pause);
            assert_eq!(w.borrow().admission.len(), 1, "parked");
            // A newer version whose bytes do not decode.
            shared::publish_snapshot(&h, &Snapshot::new(2, NOW, vec![ep(0, 0.1)]).encode())
                .unwrap();
            h.shared_set(crate::names::SNAPSHOT_KEY, b"junk", None)
                .unwrap();
            let resumed = w.borrow_mut().tick(&h);
            assert_eq!(w.borrow().admission.len(), 0, "fail_open {fail_open}");
            assert_eq!(h.metric(metric::FAIL_OPEN), 1, "fail_open {fail_open}");
            if fail_open {
                assert_eq!(resumed, 1);
                assert_eq!(
                    h.ctx_events.borrow().clone(),
                    vec![(9, "resume".to_string())]
                );
                assert_eq!(s.on_response_headers(&r, false), Flow::Continue);
                assert_eq!(
                    r.response_header(DECISION_HEADER).as_deref(),
                    Some("fail_open")
                );
            } else {
                assert_eq!(resumed, 0);
                assert_eq!(
                    h.ctx_events.borrow().clone(),
                    vec![(9, "reply:503".to_string())]
                );
            }
            s.on_done(&r);
            assert!(w.borrow().resumed.is_empty(), "fail_open {fail_open}");
            s_flush(&w, &h);
            assert_eq!(held(&h), 0);
        }
    }

    /// Endpoint mode: a response from an upstream none of the endpoint header's hosts
    /// names (Envoy's cluster has no host at the chosen address, so its fallback policy
    /// chose one) is counted and logged, naming both; one from a named host is not. The
    /// check reads `upstream.address` once per endpoint per `UPSTREAM_CHECK_MS`; cluster
    /// mode never reads it.
    #[test]
    fn endpoint_mode_reports_an_upstream_the_filter_did_not_choose() {
        // One response on a fresh stream, the upstream Envoy reached set to `upstream`:
        // how many times the filter read it.
        let respond = |h: &MockHost, w: &Rc<RefCell<Worker>>, upstream: &str| -> u32 {
            let r = request(h, "/v1/chat/completions", BODY)
                .with_property("upstream.address", upstream);
            let mut s = Stream::new(w.clone(), 7);
            s.on_request_headers(&r, false);
            assert_eq!(s.on_request_body(&r, BODY.len(), true), Flow::Continue);
            s.on_response_headers(&r, false);
            let reads = r.calls.borrow().get("property").copied().unwrap_or(0);
            s.on_done(&r);
            reads
        };
        let cfg = r#"{"mode":"endpoint","picker":{"policy":"least_kv","max_fallbacks":1}}"#;
        let (h, w) = setup(cfg, vec![ep(0, 0.1), ep(1, 0.5)]);
        // A request that ends before its response headers (aborted) checks nothing and
        // leaves the endpoint due.
        let r = request(&h, "/v1/chat/completions", BODY);
        let mut s = Stream::new(w.clone(), 6);
        s.on_request_headers(&r, false);
        s.on_request_body(&r, BODY.len(), true);
        s.on_done(&r);
        // The primary (10.0.0.0) or the fallback (10.0.0.1, after a retry): as chosen.
        assert_eq!(respond(&h, &w, "10.0.0.1:8000"), 1);
        assert_eq!(h.metric(metric::UPSTREAM_MISMATCH), 0);
        assert!(h.logs.borrow().is_empty(), "{:?}", h.logs.borrow());
        // Checked 10 s ago at most: not read again, whatever it would show.
        *h.now.borrow_mut() += UPSTREAM_CHECK_MS - 1;
        assert_eq!(respond(&h, &w, "10.0.0.9:8000"), 0);
        assert_eq!(h.metric(metric::UPSTREAM_MISMATCH), 0);
        // Due again: an upstream the filter did not choose.
        *h.now.borrow_mut() += 1;
        assert_eq!(respond(&h, &w, "10.0.0.9:8000"), 1);
        assert_eq!(h.metric(metric::UPSTREAM_MISMATCH), 1);
        assert_eq!(
            *h.logs.borrow(),
            [
                "kvroute: endpoint mode: a request routed to endpoint pool/e0 \
                 (10.0.0.0:8000,10.0.0.1:8000) reached upstream 10.0.0.9:8000, none of those: \
                 Envoy's fallback policy chose it, because the cluster has no host at a listed \
                 address (give endpoints the cluster hosts' IPs, written as Envoy writes them) \
                 or every listed host failed (docs/filter.md, \"Endpoint mode\")"
            ]
        );
        // Cluster mode: never read.
        let (h, w) = setup("{}", vec![ep(0, 0.1), ep(1, 0.5)]);
        assert_eq!(respond(&h, &w, "10.0.0.9:8000"), 0);
        assert_eq!(h.metric(metric::UPSTREAM_MISMATCH), 0);
    }
}
