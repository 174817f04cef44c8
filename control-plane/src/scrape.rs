//! Scraping: one tokio task per endpoint.
//!
//! Each task loops: GET the metrics URL (keep-alive connection from a shared hyper-util
//! pool), read at most `scrape.max_body_bytes`, parse ([`crate::expo`]), extract
//! ([`crate::adapters`]), record into the [`Hub`], then sleep
//! `interval × (1 + U(0, jitter))` measured from the start of the scrape. A task only ever
//! waits on its own endpoint, so a hung endpoint delays nobody else. The first scrape of
//! each task starts after `U(0, interval)` so a large fleet is spread over the interval.
//!
//! **One timeout and one result per signal.** `/metrics` is the primary signal; llama.cpp's
//! `GET /slots` is secondary. Each request runs under its own `scrape.timeout`, and when
//! the kind is known to be llama.cpp both run at once. A slow or failed `/slots` never
//! hides `/metrics`: queue depths and counters are recorded, and KV usage comes from the
//! previous `/slots` reading while it is younger than [`SLOTS_CARRY_MAX`], else it is
//! unknown. A busy llama-server answers `/metrics` at once but `/slots` only between
//! batches, so `/slots` regularly takes seconds during long prompt processing.
//!
//! **What a failure means** ([`ScrapeError::class`], applied by [`Hub::record_failure`]):
//! - `/metrics` timed out → the endpoint is reachable but slow: its stats go *stale*
//!   (kept, `healthy` unchanged, `scraped_at_ms` not advanced). The picker ranks stale
//!   endpoints after fresh ones and falls back to least-request over them when nothing is
//!   fresh (`kvroute_core::picker`), so a busy fleet is never answered with 503.
//! - connection refused, reset, or no TCP connection within half the scrape timeout →
//!   *unreachable*: down after [`crate::hub::DOWN_AFTER_UNREACHABLE`] in a row.
//! - an answer that is not a usable exposition (non-200 status, e.g. llama.cpp's 503 while
//!   loading; a body over the size limit; no sample line; no metrics of the kind) →
//!   *not ready*: down at once. A 401 or 403 says the server wants credentials
//!   (llama-server `--api-key`): its error names `scrape.token_file` / `scrape.token_env`.
//!
//! **Credentials.** With a scrape token ([`crate::config::ScrapeSettings::token`]), every
//! request (`/metrics` and `/slots`) carries `Authorization: Bearer <token>`, read from a
//! [`TokenRx`] at each scrape so that a rotated token file applies to the next scrape.
//!
//! Failures are logged at `warn` with their cause, at most once per
//! [`WARN_EVERY`] per endpoint and signal (with the number of failures since the last
//! line), and recovery at `info`.
//!
//! Body buffers: a body is read frame by frame into a `Vec<u8>` taken from a small shared
//! pool ([`BODY_POOL_MAX`] buffers of at most [`BODY_POOL_MAX_CAPACITY`] bytes) and handed
//! back when the scrape ends, cancelled or not. At 1,000 endpoints a second this replaces a
//! fresh ~42 KiB allocation plus a copy per scrape (`collect().to_bytes()`), which profiled
//! as the largest single cost after the snapshot encoding (glibc `malloc_consolidate` on
//! every large allocation). Few scrapes run at the same instant, so a handful of buffers
//! serve the whole fleet.

use crate::adapters::{self, AdapterError, ServerKind, ServerStats};
use crate::config::{EndpointSpec, ScrapeSettings};
use crate::expo::{ExpoError, Exposition};
use crate::hub::{now_ms, Hub};
use crate::telemetry::EndpointLabel;
use crate::token::TokenRx;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// HTTP client used for scrapes (`http://` and `https://`, [`crate::tls`]).
pub type ScrapeClient = Client<crate::tls::Connector, Empty<Bytes>>;

/// A client with keep-alive and `TCP_NODELAY`; idle connections live 90 s. The read
/// buffer is fixed at 16 KiB: hyper's adaptive buffer grows to the body size and an idle
/// pooled connection keeps it, which at 1,000 endpoints × ~64 KiB is most of the RSS.
/// `connect_timeout`: [`connect_timeout`] of the scrape timeout, so that a host that does
/// not answer SYNs shows as unreachable rather than slow. `tls` is used for `https://` URLs.
pub fn client(connect_timeout: Duration, tls: &crate::tls::TlsRx) -> ScrapeClient {
    let conn = crate::tls::connector(connect_timeout, tls);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .http1_read_buf_exact_size(16 * 1024)
        .build(conn)
}

/// The TCP connect timeout for a scrape timeout: half of it. A connect that takes longer
/// fails as [`ScrapeError::Connect`] (unreachable) before the request as a whole times out
/// (slow), so the two are told apart. In-cluster connects take well under a millisecond.
pub fn connect_timeout(scrape_timeout: Duration) -> Duration {
    scrape_timeout / 2
}

/// How long a `/slots` reading stands in for a failed `/slots` request (10 s, about 50
/// default scrape intervals): long enough to cover prompt processing that blocks `/slots`
/// for seconds, short enough that a wedged `/slots` turns KV usage unknown rather than
/// frozen.
pub const SLOTS_CARRY_MAX: Duration = Duration::from_secs(10);

/// At most one `warn` line per endpoint and signal in this period while failures continue.
pub const WARN_EVERY: Duration = Duration::from_secs(30);

/// What a failed scrape says about the endpoint (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// Reachable but did not answer in time: stats stale, health unchanged.
    Stale,
    /// No connection: down after repeated failures.
    Unreachable,
    /// Answered, but not with a usable exposition: down now.
    NotReady,
}

/// Why one scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// Did not finish within `scrape.timeout`.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// Connection failure (refused, reset, connect timeout, DNS).
    #[error("request failed: {0}")]
    Connect(String),
    /// Non-200 answer; 401 and 403 add [`CREDENTIALS_HINT`].
    #[error("HTTP status {0}{hint}", hint = credentials_hint(*.0))]
    Status(u16),
    /// Body larger than `scrape.max_body_bytes`.
    #[error("body: {0}")]
    Body(String),
    /// Not a Prometheus exposition.
    #[error("not a Prometheus exposition: {0}")]
    Parse(#[from] ExpoError),
    /// Not the configured/any known server kind.
    #[error("{0}")]
    Adapter(#[from] AdapterError),
}

impl ScrapeError {
    /// Short class used as the `reason` metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Timeout(_) => "timeout",
            Self::Connect(_) => "connect",
            Self::Status(_) => "status",
            Self::Body(_) => "body",
            Self::Parse(_) => "parse",
            Self::Adapter(_) => "adapter",
        }
    }

    /// What this failure says about the endpoint's health.
    pub fn class(&self) -> FailureClass {
        match self {
            Self::Timeout(_) => FailureClass::Stale,
            Self::Connect(_) => FailureClass::Unreachable,
            Self::Status(_) | Self::Body(_) | Self::Parse(_) | Self::Adapter(_) => {
                FailureClass::NotReady
            }
        }
    }
}

/// Appended to a 401 or 403 scrape error (the `scrape failed` warning, the endpoint's
/// `last_error`): the server wants credentials, which kvroute-cp sends from the scrape
/// token settings.
pub const CREDENTIALS_HINT: &str = ": the server wants credentials (e.g. llama-server \
     `--api-key`); put its key in `scrape.token_file` or `scrape.token_env`, or in its \
     pool's `scrape_token_file` or `scrape_token_env` (sent as `Authorization: Bearer`), \
     or check the key there";

/// [`CREDENTIALS_HINT`] for 401 and 403, else nothing.
fn credentials_hint(status: u16) -> &'static str {
    match status {
        401 | 403 => CREDENTIALS_HINT,
        _ => "",
    }
}

/// Most idle body buffers kept for reuse.
pub const BODY_POOL_MAX: usize = 16;
/// Buffers that grew beyond this many bytes are freed rather than kept (1 MiB).
pub const BODY_POOL_MAX_CAPACITY: usize = 1024 * 1024;

static BODY_POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// A pooled body buffer; goes back to the pool on drop (also when a timeout cancels the
/// scrape).
struct BodyBuf(Vec<u8>);

impl BodyBuf {
    fn take() -> Self {
        let v = BODY_POOL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop()
            .unwrap_or_default();
        Self(v)
    }
}

impl Drop for BodyBuf {
    fn drop(&mut self) {
        let mut v = std::mem::take(&mut self.0);
        if v.capacity() > BODY_POOL_MAX_CAPACITY {
            return;
        }
        v.clear();
        let mut pool = BODY_POOL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if pool.len() < BODY_POOL_MAX {
            pool.push(v);
        }
    }
}

/// GET `url` into `buf` (cleared first), at most `limit` body bytes; with `token`, the
/// request carries `Authorization: Bearer <token>`.
async fn get(
    client: &ScrapeClient,
    url: &http::Uri,
    accept: &'static str,
    token: Option<&str>,
    limit: usize,
    buf: &mut Vec<u8>,
) -> Result<(), ScrapeError> {
    buf.clear();
    let mut req = http::Request::get(url.clone()).header(http::header::ACCEPT, accept);
    if let Some(t) = token {
        req = req.header(http::header::AUTHORIZATION, crate::token::bearer(t));
    }
    let req = req
        .body(Empty::<Bytes>::new())
        .map_err(|e| ScrapeError::Connect(e.to_string()))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| ScrapeError::Connect(error_chain(&e)))?;
    let status = resp.status();
    if status != http::StatusCode::OK {
        return Err(ScrapeError::Status(status.as_u16()));
    }
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ScrapeError::Connect(format!("reading the body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if buf.len().saturating_add(data.len()) > limit {
                return Err(ScrapeError::Body(format!(
                    "larger than scrape.max_body_bytes ({limit})"
                )));
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(())
}

/// `error: cause: cause` for a client error (hyper-util's `Display` alone says only
/// "client error (Connect)"), e.g. `client error (Connect): tcp connect error: Connection
/// refused (os error 111)`. The scrape and the push both report connection failures so.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// What `Accept` the scrape sends for `/metrics`: both text formats, OpenMetrics first, as
/// Prometheus does (the reader takes either).
pub const METRICS_ACCEPT: &str =
    "application/openmetrics-text;version=1.0.0;q=0.9,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// The outcome of one scrape: the primary signal's stats, and the secondary signal's
/// failure if it failed.
#[derive(Debug)]
pub struct Scraped {
    /// Stats from `/metrics` (plus `/slots` for llama.cpp when it answered).
    pub stats: ServerStats,
    /// Why `/slots` failed, when it was requested and failed.
    pub slots_error: Option<ScrapeError>,
    /// Malformed `/metrics` lines skipped, and the first of them (line, reason).
    pub skipped: (usize, Option<(usize, &'static str)>),
}

/// Bodies longer than this, bytes, are parsed on tokio's blocking pool rather than on the
/// runtime's one worker thread (`main.rs`): a label-heavy 8 MB body took ~300 ms to parse,
/// and every other scrape, push and `/metrics` answer waited behind it. Real expositions
/// are far smaller (the largest in the shared data, TGI's, is 58 KiB), so they stay inline and cost
/// no thread hand-off.
pub const PARSE_OFFLOAD_BYTES: usize = 1 << 20;

/// Parse a `/metrics` body, keeping the families the adapters read; bodies over
/// [`PARSE_OFFLOAD_BYTES`] on the blocking pool. The body goes back to the buffer pool
/// either way.
async fn parse_metrics(body: BodyBuf) -> Result<Exposition, ScrapeError> {
    if body.0.len() <= PARSE_OFFLOAD_BYTES {
        return Ok(Exposition::parse_bytes_with(
            &body.0,
            adapters::is_relevant,
        )?);
    }
    tokio::task::spawn_blocking(move || {
        Exposition::parse_bytes_with(&body.0, adapters::is_relevant)
    })
    .await
    .map_err(|e| ScrapeError::Body(format!("parse task failed: {e}")))?
    .map_err(ScrapeError::from)
}

/// Scrape one endpoint once: `/metrics` under `timeout`, and for llama.cpp `/slots` under
/// its own `timeout` (concurrently when `kind_hint` is already llama.cpp). `kind_hint` is
/// the kind detected last time for `auto` endpoints. Both requests carry `token` as a
/// bearer token when given.
pub async fn scrape_once(
    client: &ScrapeClient,
    spec: &EndpointSpec,
    kind_hint: Option<ServerKind>,
    token: Option<&str>,
    timeout: Duration,
    max_body_bytes: usize,
) -> Result<Scraped, ScrapeError> {
    let slots_url = spec.slots_url.as_ref();
    let known = match spec.kind {
        ServerKind::Auto => kind_hint,
        k => Some(k),
    };
    let fetch_slots = |url: &http::Uri| {
        let url = url.clone();
        async move {
            let mut b = BodyBuf::take();
            match tokio::time::timeout(
                timeout,
                get(
                    client,
                    &url,
                    "application/json",
                    token,
                    max_body_bytes,
                    &mut b.0,
                ),
            )
            .await
            {
                Ok(Ok(())) => Ok(b),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(ScrapeError::Timeout(timeout)),
            }
        }
    };
    let fetch_metrics = async {
        let mut body = BodyBuf::take();
        match tokio::time::timeout(
            timeout,
            get(
                client,
                &spec.metrics_url,
                METRICS_ACCEPT,
                token,
                max_body_bytes,
                &mut body.0,
            ),
        )
        .await
        {
            Ok(Ok(())) => Ok(body),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ScrapeError::Timeout(timeout)),
        }
    };
    let (metrics, early_slots) = match (known, slots_url) {
        (Some(ServerKind::Llamacpp), Some(url)) => {
            let (m, s) = tokio::join!(fetch_metrics, fetch_slots(url));
            (m, Some(s))
        }
        _ => (fetch_metrics.await, None),
    };
    let expo = parse_metrics(metrics?).await?;
    let kind = match spec.kind {
        ServerKind::Auto => adapters::detect(&expo).ok_or(AdapterError::UnknownKind)?,
        k => k,
    };
    let slots = match (kind, early_slots, slots_url) {
        (ServerKind::Llamacpp, Some(s), _) => Some(s),
        (ServerKind::Llamacpp, None, Some(url)) => Some(fetch_slots(url).await),
        _ => None,
    };
    let (slots_body, slots_error) = match slots {
        Some(Ok(b)) => (Some(b), None),
        Some(Err(e)) => (None, Some(e)),
        None => (None, None),
    };
    let stats = adapters::extract(kind, &expo, slots_body.as_ref().map(|b| b.0.as_slice()))?;
    Ok(Scraped {
        stats,
        slots_error,
        skipped: (expo.skipped, expo.first_skipped),
    })
}

/// Rate-limited `warn` lines for one endpoint and signal.
#[derive(Default)]
struct Warner {
    last: Option<Instant>,
    failures: u64,
}

impl Warner {
    /// Count a failure; true when a line should be written now.
    fn fail(&mut self) -> bool {
        self.failures += 1;
        let due = self.last.is_none_or(|t| t.elapsed() >= WARN_EVERY);
        if due {
            self.last = Some(Instant::now());
        }
        due
    }

    /// A success: the number of failures since the last success, resetting.
    fn recover(&mut self) -> u64 {
        self.last = None;
        std::mem::take(&mut self.failures)
    }
}

/// What to tell the operator a failure means for routing. An unreachable endpoint is down
/// only from its [`crate::hub::DOWN_AFTER_UNREACHABLE`]th connection failure in a row, so
/// the line says so rather than read as "down" at the first.
fn consequence(class: FailureClass) -> std::borrow::Cow<'static, str> {
    match class {
        FailureClass::Stale => {
            "stats are stale: routed with lower priority, not marked down".into()
        }
        FailureClass::Unreachable => format!(
            "marked down at {} connection failures in a row (`failures`: how many so far)",
            crate::hub::DOWN_AFTER_UNREACHABLE
        )
        .into(),
        FailureClass::NotReady => "marked down until it answers with its metrics".into(),
    }
}

/// The per-endpoint loop; returns when `shutdown` turns true. Each scrape reads the current
/// token from `token` ([`crate::token`]), so a rotated token is used without a restart.
pub async fn run_endpoint(
    hub: Arc<Hub>,
    client: ScrapeClient,
    spec: EndpointSpec,
    settings: ScrapeSettings,
    token: TokenRx,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut rng = fastrand::Rng::with_seed(seed(&spec.id));
    let first = settings.interval.mul_f64(rng.f64());
    tokio::select! {
        _ = tokio::time::sleep(first) => {}
        _ = shutdown.changed() => return,
    }
    let label = EndpointLabel {
        endpoint: spec.id.clone(),
    };
    let mut spec = spec;
    let mut kind_hint = None;
    let mut metrics_warn = Warner::default();
    let mut slots_warn = Warner::default();
    let mut skipped_warn = Warner::default();
    // Last `/slots` reading: when, KV usage, capacity.
    let mut last_slots: Option<(Instant, Option<f64>, Option<u64>)> = None;
    loop {
        let started = Instant::now();
        // The scrape's time is when it began: a reservation made while it runs (a busy
        // llama-server's `/slots` can take seconds) was not in its `/metrics`, and must
        // count as unseen, not as seen by a scrape stamped at its end.
        let started_ms = now_ms();
        let bearer = token.borrow().clone();
        let result = scrape_once(
            &client,
            &spec,
            kind_hint,
            bearer.as_deref(),
            settings.timeout,
            settings.max_body_bytes,
        )
        .await;
        hub.telemetry
            .scrape_duration
            .get_or_create(&label)
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(Scraped {
                mut stats,
                slots_error,
                skipped,
            }) => {
                kind_hint = Some(stats.kind);
                if let (n @ 1.., Some((line, reason))) = skipped {
                    hub.telemetry
                        .skipped_lines
                        .get_or_create(&label)
                        .inc_by(n as u64);
                    if skipped_warn.fail() {
                        tracing::warn!(
                            endpoint = %spec.id,
                            url = %spec.metrics_url,
                            skipped = n,
                            first_line = line,
                            reason,
                            "malformed /metrics lines skipped; the rest of the scrape is used"
                        );
                    }
                }
                let n = metrics_warn.recover();
                if n > 0 {
                    tracing::info!(endpoint = %spec.id, failures = n, "scrape recovered");
                }
                match slots_error {
                    None => {
                        if stats.kind == ServerKind::Llamacpp {
                            last_slots = Some((started, stats.kv_usage, stats.kv_capacity_tokens));
                            let n = slots_warn.recover();
                            if n > 0 {
                                tracing::info!(endpoint = %spec.id, failures = n, "/slots recovered");
                            }
                        }
                    }
                    Some(ScrapeError::Status(code @ (404 | 501))) => {
                        // `llama-server --no-slots` answers 501; an old build or a proxy 404.
                        tracing::warn!(
                            endpoint = %spec.id,
                            status = code,
                            "llama.cpp /slots is disabled (start llama-server without --no-slots \
                             for KV usage); no longer asking it, KV usage unknown"
                        );
                        hub.scrape_error(&spec.id, "slots_status");
                        spec.slots_url = None;
                    }
                    Some(e) => {
                        hub.scrape_error(&spec.id, slots_reason(&e));
                        let carried = last_slots.filter(|(t, _, _)| t.elapsed() <= SLOTS_CARRY_MAX);
                        if let Some((_, usage, cap)) = carried {
                            stats.kv_usage = usage;
                            stats.kv_capacity_tokens = cap;
                        }
                        if slots_warn.fail() {
                            tracing::warn!(
                                endpoint = %spec.id,
                                url = %spec.slots_url.as_ref().map(ToString::to_string).unwrap_or_default(),
                                error = %e,
                                failures = slots_warn.failures,
                                kv_usage = if carried.is_some() { "previous /slots reading" } else { "unknown" },
                                "llama.cpp /slots failed; /metrics data kept, endpoint stays healthy"
                            );
                        }
                    }
                }
                hub.record_success(&spec.id, stats, started_ms);
            }
            Err(e) => {
                let class = e.class();
                if metrics_warn.fail() {
                    tracing::warn!(
                        endpoint = %spec.id,
                        url = %spec.metrics_url,
                        error = %e,
                        failures = metrics_warn.failures,
                        "scrape failed; {}",
                        consequence(class)
                    );
                }
                hub.scrape_error(&spec.id, e.reason());
                hub.record_failure(&spec.id, class, e.to_string());
            }
        }
        let wait = settings.interval.mul_f64(1.0 + settings.jitter * rng.f64());
        tokio::select! {
            _ = tokio::time::sleep_until((started + wait).into()) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// Metric `reason` for a failed `/slots` request.
fn slots_reason(e: &ScrapeError) -> &'static str {
    match e {
        ScrapeError::Timeout(_) => "slots_timeout",
        ScrapeError::Connect(_) => "slots_connect",
        ScrapeError::Status(_) => "slots_status",
        _ => "slots_body",
    }
}

fn seed(id: &str) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0);
    id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    }) ^ nanos
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unreachable_warning_states_the_down_threshold() {
        let line = consequence(FailureClass::Unreachable);
        assert_eq!(
            line,
            "marked down at 2 connection failures in a row (`failures`: how many so far)"
        );
    }

    #[test]
    fn only_401_and_403_name_the_scrape_token_settings() {
        let hint = ": the server wants credentials (e.g. llama-server `--api-key`); put its key \
                    in `scrape.token_file` or `scrape.token_env`, or in its pool's \
                    `scrape_token_file` or `scrape_token_env` (sent as `Authorization: \
                    Bearer`), or check the key there";
        assert_eq!(
            ScrapeError::Status(401).to_string(),
            format!("HTTP status 401{hint}")
        );
        assert_eq!(
            ScrapeError::Status(403).to_string(),
            format!("HTTP status 403{hint}")
        );
        assert_eq!(ScrapeError::Status(503).to_string(), "HTTP status 503");
        assert_eq!(ScrapeError::Status(404).to_string(), "HTTP status 404");
    }

    #[test]
    fn a_connection_error_is_reported_with_its_causes() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("client error (Connect)")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Outer(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "tcp connect error",
        ));
        assert_eq!(error_chain(&e), "client error (Connect): tcp connect error");
    }
}
