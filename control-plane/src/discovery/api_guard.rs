//! A guard between kube-rs and the Kubernetes API server ([`ApiGuardLayer`], applied by
//! `app.rs` with kube's `ClientBuilder::with_layer`), so that an API server (or a proxy in
//! front of it) that misbehaves costs kvroute-cp bounded memory and CPU. Found by a breaker
//! (2026-12-05) against a fake API server:
//!
//! - **Watches that end as soon as they start.** kube-runtime's watcher backs off after an
//!   error, but starts the next watch at once after a clean end: an API server answering
//!   every watch with an empty 200 got ~10,000 watch requests a second, 37 % of a core and
//!   no log line. A watch of one kind (below) starts at most once per
//!   [`MIN_WATCH_INTERVAL`] here, with a `warn` (at most every [`WARN_EVERY`] per kind) when
//!   that holds one back.
//! - **A watch event that never ends.** kube-client reads watch streams line by line
//!   without a line bound (RSS 6.7 GB in 10 s). A watch body's line may be at most
//!   [`MAX_WATCH_LINE_BYTES`]; past it the body fails and the watcher backs off and
//!   re-lists.
//! - **A list that never ends.** A list body (any response that is not a watch) may be at
//!   most [`MAX_RESPONSE_BYTES`] (it reached 6.2 GB in 5 s).
//! - **The same failure again at once.** kube-runtime re-listed a list that failed that way
//!   every ~0.9 s, 256 MiB each time, its backoff never growing. After a body of a
//!   request fails (a bound passed, or the connection broke mid-body), the next request of
//!   the same kind waits [`FAILURE_BACKOFF`], doubling per failure up to
//!   [`MAX_FAILURE_BACKOFF`]; a body read to its end clears it.
//!
//! A request's kind is its path, label and field selectors, and whether it is a watch
//! ([`request_key`]; not its `resourceVersion`): pools in one namespace watch the same pods
//! path with their own selectors, and must not hold each other back.
//!
//! kube-rs's requests are lazy: the inner service's future does its I/O when polled, so a
//! watch held back is not sent until its wait is over.

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Shortest time between the starts of two watches of one kind (1 s; a healthy watch
/// lasts minutes, until the server's timeout).
pub const MIN_WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// Longest line of a watch body, bytes (16 MiB; one event is one object, a pod ~10 KB).
pub const MAX_WATCH_LINE_BYTES: u64 = 16 * 1024 * 1024;
/// Longest body of any other response, bytes (256 MiB; lists are narrowed by the pool's
/// label selector).
pub const MAX_RESPONSE_BYTES: u64 = 256 * 1024 * 1024;
/// Least time between two warnings of held-back watches of one kind.
pub const WARN_EVERY: Duration = Duration::from_secs(30);
/// Wait before a request whose kind's last body failed (1 s), doubling per failure.
pub const FAILURE_BACKOFF: Duration = Duration::from_secs(1);
/// Longest [`FAILURE_BACKOFF`] wait (30 s, kube-runtime's own longest backoff).
pub const MAX_FAILURE_BACKOFF: Duration = Duration::from_secs(30);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// By request kind ([`request_key`]): when its last watch started and when held-back
/// watches of it were last logged; and its body failures in a row, with the last one's time.
#[derive(Default)]
struct History {
    watches: HashMap<String, (Instant, Option<Instant>)>,
    failures: HashMap<String, (u32, Instant)>,
}

/// What tells requests apart: the path and the label and field selectors, watch or list.
fn request_key(uri: &http::Uri, watch: bool) -> String {
    let mut selectors: Vec<&str> = uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|kv| kv.starts_with("labelSelector=") || kv.starts_with("fieldSelector="))
        .collect();
    selectors.sort_unstable();
    format!(
        "{} {}?{}",
        if watch { "watch" } else { "get" },
        uri.path(),
        selectors.join("&")
    )
}

/// The [`tower_layer::Layer`] of [`ApiGuard`].
#[derive(Clone, Default)]
pub struct ApiGuardLayer {
    starts: Arc<Mutex<History>>,
}

impl<S> tower_layer::Layer<S> for ApiGuardLayer {
    type Service = ApiGuard<S>;

    fn layer(&self, inner: S) -> ApiGuard<S> {
        ApiGuard {
            inner,
            starts: self.starts.clone(),
        }
    }
}

/// The guarded service (see the module docs).
pub struct ApiGuard<S> {
    inner: S,
    starts: Arc<Mutex<History>>,
}

/// Whether `uri` asks for a watch (`watch=true` or `watch=1` in its query).
fn is_watch(uri: &http::Uri) -> bool {
    uri.query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

fn lock(starts: &Mutex<History>) -> std::sync::MutexGuard<'_, History> {
    starts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<S> ApiGuard<S> {
    /// How long a request of kind `key` made at `now` must wait after failed bodies.
    fn failure_wait(&self, key: &str, now: Instant) -> Duration {
        let starts = lock(&self.starts);
        let Some(&(n, last)) = starts.failures.get(key) else {
            return Duration::ZERO;
        };
        let backoff = FAILURE_BACKOFF
            .saturating_mul(1u32 << n.saturating_sub(1).min(5))
            .min(MAX_FAILURE_BACKOFF);
        (last + backoff).saturating_duration_since(now)
    }

    /// How long a watch of kind `key` starting at `now` must wait; records its start.
    fn watch_wait(&self, key: &str, now: Instant) -> Duration {
        let mut starts = lock(&self.starts);
        let Some(entry) = starts.watches.get_mut(key) else {
            starts.watches.insert(key.to_owned(), (now, None));
            return Duration::ZERO;
        };
        let earliest = entry.0 + MIN_WATCH_INTERVAL;
        if earliest <= now {
            entry.0 = now;
            return Duration::ZERO;
        }
        entry.0 = earliest;
        if entry.1.is_none_or(|w| now.duration_since(w) >= WARN_EVERY) {
            entry.1 = Some(now);
            tracing::warn!(
                kind = key,
                "Kubernetes watches end as soon as they start; starting them at most once a second"
            );
        }
        earliest - now
    }
}

impl<S, ReqBody, B> tower_service::Service<http::Request<ReqBody>> for ApiGuard<S>
where
    S: tower_service::Service<http::Request<ReqBody>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<Bounded<B>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let watch = is_watch(req.uri());
        let key = request_key(req.uri(), watch);
        let now = Instant::now();
        let mut wait = self.failure_wait(&key, now);
        if watch {
            wait = wait.max(self.watch_wait(&key, now));
        }
        let limit = if watch {
            Limit::Line(MAX_WATCH_LINE_BYTES)
        } else {
            Limit::Total(MAX_RESPONSE_BYTES)
        };
        let fut = self.inner.call(req);
        let starts = self.starts.clone();
        Box::pin(async move {
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            let resp = fut.await.map_err(Into::into)?;
            Ok(resp.map(|body| Bounded {
                inner: Box::pin(body),
                limit,
                seen: 0,
                outcome: Some((starts, key)),
            }))
        })
    }
}

/// What a [`Bounded`] body may hold.
#[derive(Debug, Clone, Copy)]
enum Limit {
    /// At most this many bytes in all.
    Total(u64),
    /// At most this many bytes between two line feeds.
    Line(u64),
}

/// A response body that fails once it passes its [`Limit`].
pub struct Bounded<B> {
    inner: Pin<Box<B>>,
    limit: Limit,
    /// Bytes counted against the limit so far.
    seen: u64,
    /// Where to record how the body ended (failed, or read to its end), once.
    outcome: Option<(Arc<Mutex<History>>, String)>,
}

impl<B> Bounded<B> {
    /// Record the body's end: a failure counts one more in a row, a complete body clears
    /// them.
    fn ended(&mut self, failed: bool) {
        let Some((starts, key)) = self.outcome.take() else {
            return;
        };
        let mut starts = lock(&starts);
        if failed {
            let e = starts.failures.entry(key).or_insert((0, Instant::now()));
            *e = (e.0.saturating_add(1), Instant::now());
        } else {
            starts.failures.remove(&key);
        }
    }
}

impl<B> Body for Bounded<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = match self.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => f,
            Poll::Ready(Some(Err(e))) => {
                self.ended(true);
                return Poll::Ready(Some(Err(e.into())));
            }
            Poll::Ready(None) => {
                self.ended(false);
                return Poll::Ready(None);
            }
            Poll::Pending => return Poll::Pending,
        };
        if let Some(data) = frame.data_ref() {
            let len = data.len() as u64;
            let (seen, max, what) = match self.limit {
                Limit::Total(max) => (self.seen.saturating_add(len), max, "response body"),
                Limit::Line(max) => match memchr::memrchr(b'\n', data) {
                    Some(i) => ((data.len() - i - 1) as u64, max, "watch event"),
                    None => (self.seen.saturating_add(len), max, "watch event"),
                },
            };
            self.seen = seen;
            if seen > max {
                self.ended(true);
                return Poll::Ready(Some(Err(format!(
                    "Kubernetes API {what} larger than {max} bytes"
                )
                .into())));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use http_body_util::BodyExt;

    /// A body of `chunks`, then endless copies of the last one.
    struct Chunks(Vec<Bytes>, usize);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            let i = self.1.min(self.0.len() - 1);
            self.1 += 1;
            Poll::Ready(Some(Ok(Frame::data(self.0[i].clone()))))
        }
    }

    async fn read(limit: Limit, chunks: &[&'static [u8]], frames: usize) -> Result<u64, String> {
        let mut b = Bounded {
            inner: Box::pin(Chunks(
                chunks.iter().map(|c| Bytes::from_static(c)).collect(),
                0,
            )),
            limit,
            seen: 0,
            outcome: None,
        };
        let mut n = 0u64;
        for _ in 0..frames {
            match b.frame().await {
                Some(Ok(f)) => n += f.into_data().map_or(0, |d| d.len() as u64),
                Some(Err(e)) => return Err(e.to_string()),
                None => break,
            }
        }
        Ok(n)
    }

    /// A list body fails past its total; a watch body only on a line past its bound, so a
    /// stream of events of any length flows.
    #[tokio::test]
    async fn bodies_fail_past_their_bound() {
        assert_eq!(read(Limit::Total(10), &[b"12345"], 2).await, Ok(10));
        assert_eq!(
            read(Limit::Total(10), &[b"12345"], 3).await,
            Err("Kubernetes API response body larger than 10 bytes".into())
        );
        // Events of 6 bytes and a line feed: a thousand of them pass a bound of 10.
        assert_eq!(
            read(Limit::Line(10), &[b"{\"a\":1}\n"], 1000).await,
            Ok(8000)
        );
        // A line split over frames counts across them.
        assert_eq!(
            read(Limit::Line(10), &[b"{\"a\":1}\n{\"b\"", b":2}\n"], 2).await,
            Ok(16)
        );
        assert_eq!(
            read(Limit::Line(10), &[b"{\"a\":1}\n{\"b\"", b"xxxx"], 4).await,
            Err("Kubernetes API watch event larger than 10 bytes".into())
        );
    }

    /// Requests of one kind are told apart by path and selectors, not resource version.
    #[test]
    fn requests_are_keyed_by_path_and_selectors() {
        let key = |u: &str, w| request_key(&u.parse().unwrap(), w);
        assert_eq!(
            key(
                "/api/v1/namespaces/d/pods?watch=true&resourceVersion=5&labelSelector=app%3Da",
                true
            ),
            "watch /api/v1/namespaces/d/pods?labelSelector=app%3Da"
        );
        assert_eq!(
            key(
                "/api/v1/namespaces/d/pods?labelSelector=app%3Da&resourceVersion=9&watch=true",
                true
            ),
            key(
                "/api/v1/namespaces/d/pods?watch=true&labelSelector=app%3Da",
                true
            )
        );
        assert_ne!(
            key("/api/v1/namespaces/d/pods?labelSelector=app%3Da", true),
            key("/api/v1/namespaces/d/pods?labelSelector=app%3Db", true)
        );
        assert_ne!(
            key("/p?labelSelector=x", true),
            key("/p?labelSelector=x", false)
        );
    }

    /// Failed bodies of a kind delay its next request 1 s, 2 s, 4 s ... up to 30 s; a body
    /// read to its end clears the delay; other kinds do not wait.
    #[tokio::test]
    async fn failed_bodies_back_off_their_kind() {
        let g = ApiGuardLayer::default();
        let guard: ApiGuard<()> = tower_layer::Layer::layer(&g, ());
        let outcome = || Some((g.starts.clone(), "get /p?".to_owned()));
        let now = Instant::now();
        assert_eq!(guard.failure_wait("get /p?", now), Duration::ZERO);
        let mut waits = Vec::new();
        for _ in 0..7 {
            let mut b = Bounded {
                inner: Box::pin(Chunks(vec![Bytes::from_static(b"12345")], 0)),
                limit: Limit::Total(4),
                seen: 0,
                outcome: outcome(),
            };
            assert!(b.frame().await.unwrap().is_err());
            let w = guard.failure_wait("get /p?", Instant::now());
            waits.push((w.as_secs_f64() + 0.5) as u64);
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(
            guard.failure_wait("get /q?", Instant::now()),
            Duration::ZERO
        );
        // A body read to its end (an empty one) clears them.
        let mut ok = Bounded {
            inner: Box::pin(http_body_util::Empty::<Bytes>::new()),
            limit: Limit::Total(4),
            seen: 0,
            outcome: outcome(),
        };
        assert!(ok.frame().await.is_none());
        assert_eq!(
            guard.failure_wait("get /p?", Instant::now()),
            Duration::ZERO
        );
    }

    /// A second watch of a kind within a second waits out the rest of it; another kind's
    /// and a list do not wait.
    #[test]
    fn watches_of_a_path_start_at_most_once_a_second() {
        let g = ApiGuardLayer::default();
        let guard: ApiGuard<()> = tower_layer::Layer::layer(&g, ());
        let t0 = Instant::now();
        let p = "/api/v1/namespaces/default/pods";
        assert_eq!(guard.watch_wait(p, t0), Duration::ZERO);
        assert_eq!(
            guard.watch_wait(p, t0 + Duration::from_millis(100)),
            Duration::from_millis(900)
        );
        // The one held back starts at t0 + 1 s; the next at t0 + 2 s.
        assert_eq!(
            guard.watch_wait(p, t0 + Duration::from_millis(200)),
            Duration::from_millis(1800)
        );
        assert_eq!(guard.watch_wait("/apis/x", t0), Duration::ZERO);
        assert_eq!(
            guard.watch_wait(p, t0 + Duration::from_secs(10)),
            Duration::ZERO
        );
        assert!(is_watch(
            &"/api/v1/pods?labelSelector=a%3Db&watch=true&resourceVersion=1"
                .parse()
                .unwrap()
        ));
        assert!(!is_watch(
            &"/api/v1/pods?labelSelector=watch%3Dtrue".parse().unwrap()
        ));
    }
}
