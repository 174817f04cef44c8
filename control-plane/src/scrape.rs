//! Scraping: one tokio task per endpoint.
//!
//! Each task loops: GET the metrics URL (keep-alive connection from a shared hyper-util
//! pool), read at most `scrape.max_body_bytes`, parse ([`crate::expo`]), extract
//! ([`crate::adapters`]), record into the [`Hub`], then sleep
//! `interval × (1 + U(0, jitter))` measured from the start of the scrape. The whole
//! request, connect to last byte, runs under `scrape.timeout`. A task only ever waits on its
//! own endpoint, so a hung endpoint delays nobody else. The first scrape of each task
//! starts after `U(0, interval)` so a large fleet is spread over the interval.
//!
//! Body buffers: a body is read frame by frame into a `Vec<u8>` taken from a small shared
//! pool ([`BODY_POOL_MAX`] buffers of at most [`BODY_POOL_MAX_CAPACITY`] bytes) and handed
//! back when the scrape ends, cancelled or not. At 1,000 endpoints a second this replaces a
//! fresh ~42 KiB allocation plus a copy per scrape (`collect().to_bytes()`), which profiled
//! as the largest single cost after the snapshot encoding (glibc `malloc_consolidate` on
//! every large allocation). Few scrapes run at the same instant, so a handful of buffers
//! serve the whole fleet.
//!
//! For llama.cpp, `GET /slots` follows a successful metrics read within the same timeout;
//! its failure leaves KV usage unknown but the endpoint healthy.

use crate::adapters::{self, AdapterError, ServerKind};
use crate::config::{EndpointSpec, ScrapeSettings};
use crate::expo::{ExpoError, Exposition};
use crate::hub::{now_ms, Hub};
use crate::telemetry::EndpointLabel;
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
pub fn client(connect_timeout: Duration, tls: &rustls::ClientConfig) -> ScrapeClient {
    let conn = crate::tls::connector(connect_timeout, tls);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .http1_read_buf_exact_size(16 * 1024)
        .build(conn)
}

/// Why one scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// Did not finish within `scrape.timeout`.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// Connection or protocol failure.
    #[error("request failed: {0}")]
    Connect(String),
    /// Non-200 answer.
    #[error("HTTP status {0}")]
    Status(u16),
    /// Body unreadable or larger than `scrape.max_body_bytes`.
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

/// GET `url` into `buf` (cleared first), at most `limit` body bytes.
async fn get(
    client: &ScrapeClient,
    url: &http::Uri,
    limit: usize,
    buf: &mut Vec<u8>,
) -> Result<(), ScrapeError> {
    buf.clear();
    let req = http::Request::get(url.clone())
        .header(http::header::ACCEPT, "text/plain;version=0.0.4")
        .body(Empty::<Bytes>::new())
        .map_err(|e| ScrapeError::Connect(e.to_string()))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| ScrapeError::Connect(format!("{e:?}")))?;
    let status = resp.status();
    if status != http::StatusCode::OK {
        return Err(ScrapeError::Status(status.as_u16()));
    }
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ScrapeError::Body(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            if buf.len().saturating_add(data.len()) > limit {
                return Err(ScrapeError::Body("length limit exceeded".into()));
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(())
}

/// Scrape one endpoint once (no timeout here; the caller applies it).
pub async fn scrape_once(
    client: &ScrapeClient,
    spec: &EndpointSpec,
    max_body_bytes: usize,
) -> Result<adapters::ServerStats, ScrapeError> {
    let mut body = BodyBuf::take();
    get(client, &spec.metrics_url, max_body_bytes, &mut body.0).await?;
    let text = std::str::from_utf8(&body.0).map_err(|_| ExpoError::NotUtf8)?;
    let expo = Exposition::parse_with(text, adapters::is_relevant)?;
    let kind = match spec.kind {
        ServerKind::Auto => adapters::detect(&expo).ok_or(AdapterError::UnknownKind)?,
        k => k,
    };
    let slots = match (kind, &spec.slots_url) {
        (ServerKind::Llamacpp, Some(url)) => {
            let mut b = BodyBuf::take();
            get(client, url, max_body_bytes, &mut b.0)
                .await
                .is_ok()
                .then_some(b)
        }
        _ => None,
    };
    Ok(adapters::extract(
        kind,
        &expo,
        slots.as_ref().map(|b| b.0.as_slice()),
    )?)
}

/// The per-endpoint loop; returns when `shutdown` turns true.
pub async fn run_endpoint(
    hub: Arc<Hub>,
    client: ScrapeClient,
    spec: EndpointSpec,
    settings: ScrapeSettings,
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
    loop {
        let started = Instant::now();
        let result = match tokio::time::timeout(
            settings.timeout,
            scrape_once(&client, &spec, settings.max_body_bytes),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(ScrapeError::Timeout(settings.timeout)),
        };
        hub.telemetry
            .scrape_duration
            .get_or_create(&label)
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(stats) => hub.record_success(&spec.id, stats, now_ms()),
            Err(e) => {
                tracing::debug!(endpoint = %spec.id, error = %e, "scrape failed");
                hub.telemetry.scrape_error(&spec.id, e.reason());
                hub.record_failure(&spec.id, e.to_string());
            }
        }
        let wait = settings.interval.mul_f64(1.0 + settings.jitter * rng.f64());
        tokio::select! {
            _ = tokio::time::sleep_until((started + wait).into()) => {}
            _ = shutdown.changed() => return,
        }
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
