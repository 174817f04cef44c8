//! A recording HTTP backend: a hyper server on 127.0.0.1:0 that stores every request and
//! answers with a configurable reply.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One request as the backend received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Method, e.g. `POST`.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Headers, names lower-case.
    pub headers: Vec<(String, String)>,
    /// Whole body.
    pub body: Bytes,
}

impl Recorded {
    /// First value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        super::http::find_header(&self.headers, name)
    }
}

/// What the backend answers.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A JSON body with the given status.
    Json {
        /// Status code.
        status: u16,
        /// Body.
        body: String,
    },
    /// `text/event-stream`: each string is sent as one body chunk, `gap` apart.
    Sse {
        /// Body chunks, sent in order.
        chunks: Vec<String>,
        /// Pause between chunks.
        gap: Duration,
    },
}

impl Default for Reply {
    /// 200 with an OpenAI chat completion whose `usage` is 10 prompt + 5 completion tokens.
    fn default() -> Self {
        Reply::Json {
            status: 200,
            body: openai_completion(10, 5),
        }
    }
}

/// An OpenAI-style chat completion body with the given `usage` numbers.
pub fn openai_completion(prompt_tokens: u64, completion_tokens: u64) -> String {
    format!(
        concat!(
            r#"{{"id":"cmpl-1","object":"chat.completion","created":0,"model":"m","#,
            r#""choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"#,
            r#""usage":{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":{}}}}}"#
        ),
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens
    )
}

/// A running recording backend; the server task stops when this is dropped.
#[derive(Debug)]
pub struct RecordingBackend {
    name: String,
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<Recorded>>>,
    served: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl RecordingBackend {
    /// Bind 127.0.0.1:0 and serve. Every response carries `x-backend: <name>`.
    pub async fn start(name: &str, reply: Reply) -> anyhow::Result<Self> {
        Self::start_on("127.0.0.1:0", name, reply).await
    }

    /// Like [`RecordingBackend::start`] on an explicit bind address (e.g. `[::1]:0`).
    pub async fn start_on(bind: &str, name: &str, reply: Reply) -> anyhow::Result<Self> {
        Self::serve_on(bind, name, reply, true).await
    }

    /// Like [`RecordingBackend::start`], keeping no request (only [`Self::count`]): for
    /// load generators, whose requests would otherwise fill memory.
    pub async fn start_unrecorded(name: &str, reply: Reply) -> anyhow::Result<Self> {
        Self::serve_on("127.0.0.1:0", name, reply, false).await
    }

    async fn serve_on(bind: &str, name: &str, reply: Reply, record: bool) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let requests: Arc<Mutex<Vec<Recorded>>> = Arc::default();
        let served: Arc<AtomicUsize> = Arc::default();
        let rec = record.then(|| requests.clone());
        let (count, reply, nm) = (served.clone(), Arc::new(reply), name.to_owned());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (rec, count, reply, nm) =
                    (rec.clone(), count.clone(), reply.clone(), nm.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        serve(req, rec.clone(), count.clone(), reply.clone(), nm.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(Self {
            name: name.to_owned(),
            addr,
            requests,
            served,
            task,
        })
    }

    /// Name given at start (echoed in `x-backend`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `host:port` with IPv6 in brackets.
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// All requests so far (none for [`Self::start_unrecorded`]).
    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Number of requests so far (each counted once its body is read).
    pub fn count(&self) -> usize {
        self.served.load(Ordering::Relaxed)
    }
}

impl Drop for RecordingBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type BoxBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn serve(
    req: hyper::Request<hyper::body::Incoming>,
    rec: Option<Arc<Mutex<Vec<Recorded>>>>,
    count: Arc<AtomicUsize>,
    reply: Arc<Reply>,
    name: String,
) -> Result<hyper::Response<BoxBody>, Infallible> {
    let method = req.method().to_string();
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let headers = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    if let Some(Ok(mut r)) = rec.as_ref().map(|r| r.lock()) {
        r.push(Recorded {
            method,
            path,
            headers,
            body,
        });
    }
    count.fetch_add(1, Ordering::Relaxed);
    let builder = hyper::Response::builder().header("x-backend", name);
    let resp = match &*reply {
        Reply::Json { status, body } => builder
            .status(*status)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())).boxed()),
        Reply::Sse { chunks, gap } => {
            let (chunks, gap) = (chunks.clone(), *gap);
            let (tx, body) = kvroute_sim::body::frame_channel(4);
            tokio::spawn(async move {
                for (i, c) in chunks.into_iter().enumerate() {
                    if i > 0 {
                        tokio::time::sleep(gap).await;
                    }
                    if tx
                        .send(hyper::body::Frame::data(Bytes::from(c)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
            builder
                .status(200)
                .header("content-type", "text/event-stream")
                .body(body)
        }
    };
    Ok(resp.unwrap_or_else(|_| hyper::Response::new(Full::new(Bytes::new()).boxed())))
}
