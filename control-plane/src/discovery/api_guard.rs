//! A guard between kube-rs and the Kubernetes API server ([`ApiGuardLayer`], applied by
//! `app.rs` with kube's `ClientBuilder::with_layer`), so that an API server (or a proxy in
//! front of it) that misbehaves costs kvroute-cp bounded memory and CPU. Found by a breaker
//! (2026-12-05) against a fake API server:
//!
//! - **Watches that end as soon as they start.** kube-runtime's watcher backs off after an
//!   error, but starts the next watch at once after a clean end: an API server answering
//!   every watch with an empty 200 got ~10,000 watch requests a second, 37 % of a core and
//!   no log line. A watch of a path starts at most once per [`MIN_WATCH_INTERVAL`] here,
//!   with a `warn` (at most every [`WARN_EVERY`] per path) when that holds one back.
//! - **A watch event that never ends.** kube-client reads watch streams line by line
//!   without a line bound (RSS 6.7 GB in 10 s). A watch body's line may be at most
//!   [`MAX_WATCH_LINE_BYTES`]; past it the body fails and the watcher backs off and
//!   re-lists.
//! - **A list that never ends.** A list body (any response that is not a watch) may be at
//!   most [`MAX_RESPONSE_BYTES`] (it reached 6.2 GB in 5 s).
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

/// Shortest time between the starts of two watches of one API path (1 s; a healthy watch
/// lasts minutes, until the server's timeout).
pub const MIN_WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// Longest line of a watch body, bytes (16 MiB; one event is one object, a pod ~10 KB).
pub const MAX_WATCH_LINE_BYTES: u64 = 16 * 1024 * 1024;
/// Longest body of any other response, bytes (256 MiB; lists are narrowed by the pool's
/// label selector).
pub const MAX_RESPONSE_BYTES: u64 = 256 * 1024 * 1024;
/// Least time between two warnings of held-back watches of one path.
pub const WARN_EVERY: Duration = Duration::from_secs(30);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// When each path's last watch started, and when held-back watches of it were last logged.
#[derive(Default)]
struct Starts(HashMap<String, (Instant, Option<Instant>)>);

/// The [`tower_layer::Layer`] of [`ApiGuard`].
#[derive(Clone, Default)]
pub struct ApiGuardLayer {
    starts: Arc<Mutex<Starts>>,
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
    starts: Arc<Mutex<Starts>>,
}

/// Whether `uri` asks for a watch (`watch=true` or `watch=1` in its query).
fn is_watch(uri: &http::Uri) -> bool {
    uri.query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

impl<S> ApiGuard<S> {
    /// How long a watch of `path` starting at `now` must wait; records its start.
    fn watch_wait(&self, path: &str, now: Instant) -> Duration {
        let mut starts = self
            .starts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(entry) = starts.0.get_mut(path) else {
            starts.0.insert(path.to_owned(), (now, None));
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
                path,
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
        let wait = if watch {
            self.watch_wait(req.uri().path(), Instant::now())
        } else {
            Duration::ZERO
        };
        let limit = if watch {
            Limit::Line(MAX_WATCH_LINE_BYTES)
        } else {
            Limit::Total(MAX_RESPONSE_BYTES)
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            let resp = fut.await.map_err(Into::into)?;
            Ok(resp.map(|body| Bounded {
                inner: Box::pin(body),
                limit,
                seen: 0,
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
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
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

    /// A second watch of a path within a second waits out the rest of it; another path's
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
