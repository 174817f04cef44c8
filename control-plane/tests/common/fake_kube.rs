//! A fake Kubernetes API server for discovery tests: hyper on 127.0.0.1:0, serving
//! list and watch of registered collections the way kube-apiserver does
//! (<https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes>):
//!
//! - `GET <collection>` → a `<Kind>List` with `metadata.resourceVersion`; items carry no
//!   `kind`/`apiVersion` (as the real server sends them);
//! - `GET <collection>?watch=true&resourceVersion=R` → a chunked stream of one JSON
//!   `{"type":"ADDED|MODIFIED|DELETED","object":{...}}` per line, every change after R;
//! - after [`FakeKube::compact`] (etcd compaction), open watches get one `ERROR` event with a
//!   `410 Gone` Status (`reason: Expired`) and close, and watches from an older version get
//!   the same at once, so the client must list again.
//!
//! `labelSelector` (`k=v,...`) and `fieldSelector` (`metadata.name=...`) are applied.
// Each test crate that includes this module uses part of it; the crates allow the
// test-only clippy lints (unwrap, expect, panic, indexing) at their root.
#![allow(dead_code)]

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Notify};

/// Collection path of pods in a namespace.
pub fn pods_path(ns: &str) -> String {
    format!("/api/v1/namespaces/{ns}/pods")
}

/// Collection path of InferencePools in a namespace.
pub fn pools_path(ns: &str) -> String {
    format!("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools")
}

struct Collection {
    list_kind: String,
    api_version: String,
    items: BTreeMap<String, Value>,
    log: Vec<(u64, &'static str, Value)>,
    compacted: u64,
}

#[derive(Default)]
struct State {
    rv: u64,
    collections: BTreeMap<String, Collection>,
    requests: Vec<String>,
    expire_gen: u64,
    /// Answer every watch with an empty 200 (a watch that ends as soon as it starts).
    close_watches: bool,
}

/// The fake API server.
pub struct FakeKube {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
    stop: watch::Sender<bool>,
}

fn name_of(obj: &Value) -> String {
    obj["metadata"]["name"].as_str().unwrap().to_owned()
}

fn matches(obj: &Value, labels: &[(String, String)], fields: &[(String, String)]) -> bool {
    labels
        .iter()
        .all(|(k, v)| obj["metadata"]["labels"][k].as_str() == Some(v.as_str()))
        && fields.iter().all(|(k, v)| match k.as_str() {
            "metadata.name" => obj["metadata"]["name"].as_str() == Some(v.as_str()),
            "metadata.namespace" => obj["metadata"]["namespace"].as_str() == Some(v.as_str()),
            _ => panic!("fake API server: unsupported field selector {k}"),
        })
}

fn selector(q: &BTreeMap<String, String>, key: &str) -> Vec<(String, String)> {
    q.get(key)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.split(',')
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap();
                    (k.to_owned(), v.to_owned())
                })
                .collect()
        })
        .unwrap_or_default()
}

fn gone(rv: u64, since: u64) -> Value {
    json!({"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("too old resource version: {since} ({rv})"),
        "reason": "Expired", "code": 410}})
}

type Resp = http::Response<BoxBody<Bytes, Infallible>>;

fn full(status: u16, v: &Value) -> Resp {
    let mut r = http::Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = http::StatusCode::from_u16(status).unwrap();
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

impl FakeKube {
    /// Start on 127.0.0.1, free port.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let changed = Arc::new(Notify::new());
        let (stop, stop_rx) = watch::channel(false);
        let (st, ch) = (state.clone(), changed.clone());
        let mut accept_stop = stop_rx.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    r = listener.accept() => match r { Ok(s) => s, Err(_) => continue },
                    _ = accept_stop.changed() => return,
                };
                let (st, ch, stop_rx) = (st.clone(), ch.clone(), stop_rx.clone());
                let mut conn_stop = stop_rx.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: http::Request<Incoming>| {
                        let (st, ch, stop_rx) = (st.clone(), ch.clone(), stop_rx.clone());
                        async move { Ok::<_, Infallible>(handle(req, st, ch, stop_rx)) }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = conn_stop.changed() => {}
                    }
                });
            }
        });
        Self {
            addr,
            state,
            changed,
            stop,
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Register a collection (`pods_path(ns)` with `PodList`/`v1`, ...).
    pub fn collection(&self, path: &str, list_kind: &str, api_version: &str) {
        self.state.lock().unwrap().collections.insert(
            path.to_owned(),
            Collection {
                list_kind: list_kind.into(),
                api_version: api_version.into(),
                items: BTreeMap::new(),
                log: Vec::new(),
                compacted: 0,
            },
        );
    }

    fn mutate(&self, path: &str, obj: Option<Value>, name: &str, log: bool) {
        {
            let mut s = self.state.lock().unwrap();
            s.rv += 1;
            let rv = s.rv;
            let c = s.collections.get_mut(path).expect("collection registered");
            let ev = match obj {
                Some(mut o) => {
                    o["metadata"]["resourceVersion"] = json!(rv.to_string());
                    let t = if c.items.contains_key(name) {
                        "MODIFIED"
                    } else {
                        "ADDED"
                    };
                    c.items.insert(name.to_owned(), o.clone());
                    (t, o)
                }
                None => {
                    let mut o = c.items.remove(name).expect("object exists");
                    o["metadata"]["resourceVersion"] = json!(rv.to_string());
                    ("DELETED", o)
                }
            };
            if log {
                c.log.push((rv, ev.0, ev.1));
            }
        }
        self.changed.notify_waiters();
    }

    /// Create or replace an object (ADDED or MODIFIED to watchers).
    pub fn apply(&self, path: &str, obj: Value) {
        let name = name_of(&obj);
        self.mutate(path, Some(obj), &name, true);
    }

    /// Delete an object (DELETED to watchers).
    pub fn delete(&self, path: &str, name: &str) {
        self.mutate(path, None, name, true);
    }

    /// Change the stored state without a watch event (as if the event had been compacted
    /// away); only a re-list sees it. Pair with [`FakeKube::compact`].
    pub fn apply_unseen(&self, path: &str, obj: Value) {
        let name = name_of(&obj);
        self.mutate(path, Some(obj), &name, false);
    }

    /// Delete without a watch event (see [`FakeKube::apply_unseen`]).
    pub fn delete_unseen(&self, path: &str, name: &str) {
        self.mutate(path, None, name, false);
    }

    /// Compact history: every open watch ends with `410 Gone`, and so does any watch from
    /// an older resourceVersion.
    pub fn compact(&self) {
        {
            let mut s = self.state.lock().unwrap();
            let rv = s.rv;
            for c in s.collections.values_mut() {
                c.compacted = rv;
            }
            s.expire_gen += 1;
        }
        self.changed.notify_waiters();
    }

    /// Requests seen, as `path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }

    /// How many plain list requests hit `path`.
    pub fn lists(&self, path: &str) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.starts_with(&format!("{path}?")) && !r.contains("watch=true"))
            .count()
    }

    /// From now on, answer every watch with an empty 200 at once (a broken proxy or API
    /// server: the watch ends cleanly as soon as it starts).
    pub fn close_watches(&self) {
        self.state.lock().unwrap().close_watches = true;
    }

    /// How many watch requests hit `path`.
    pub fn watches(&self, path: &str) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.starts_with(&format!("{path}?")) && r.contains("watch=true"))
            .count()
    }

    /// Stop and drop every connection.
    pub fn stop(&self) {
        let _ = self.stop.send(true);
        self.changed.notify_waiters();
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.stop();
    }
}

fn handle(
    req: http::Request<Incoming>,
    st: Arc<Mutex<State>>,
    ch: Arc<Notify>,
    mut stop: watch::Receiver<bool>,
) -> Resp {
    let path = req.uri().path().to_owned();
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| {
            (
                k.to_owned(),
                v.replace("%3D", "=")
                    .replace("%2C", ",")
                    .replace("%2F", "/"),
            )
        })
        .collect();
    let labels = selector(&query, "labelSelector");
    let fields = selector(&query, "fieldSelector");
    let mut s = st.lock().unwrap();
    s.requests
        .push(format!("{path}?{}", req.uri().query().unwrap_or("")));
    let rv_now = s.rv;
    let gen = s.expire_gen;
    let Some(c) = s.collections.get(&path) else {
        return full(
            404,
            &json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
                    "message":format!("the server could not find the requested resource ({path})"),
                    "reason":"NotFound","code":404}),
        );
    };
    if query.get("watch").map(String::as_str) != Some("true")
        && query.get("watch").map(String::as_str) != Some("1")
    {
        let items: Vec<Value> = c
            .items
            .values()
            .filter(|o| matches(o, &labels, &fields))
            .map(|o| {
                let mut o = o.clone();
                let m = o.as_object_mut().unwrap();
                m.remove("kind");
                m.remove("apiVersion");
                o
            })
            .collect();
        return full(
            200,
            &json!({"kind": c.list_kind, "apiVersion": c.api_version,
                    "metadata": {"resourceVersion": rv_now.to_string()}, "items": items}),
        );
    }
    let since: u64 = query
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if s.close_watches {
        return http::Response::new(Full::new(Bytes::new()).boxed());
    }
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    if since < c.compacted {
        let _ = tx.try_send(Bytes::from(format!("{}\n", gone(rv_now, since))));
        drop(tx);
    } else {
        drop(s);
        tokio::spawn(async move {
            let mut sent = since;
            loop {
                let notified = ch.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let (lines, expired) = {
                    let s = st.lock().unwrap();
                    let c = &s.collections[&path];
                    let lines: Vec<(u64, Value)> = c
                        .log
                        .iter()
                        .filter(|(rv, _, o)| *rv > sent && matches(o, &labels, &fields))
                        .map(|(rv, t, o)| (*rv, json!({"type": t, "object": o})))
                        .collect();
                    (lines, (s.expire_gen != gen).then_some(s.rv))
                };
                if let Some(rv) = expired {
                    let _ = tx.send(Bytes::from(format!("{}\n", gone(rv, sent)))).await;
                    return;
                }
                for (rv, line) in lines {
                    sent = rv;
                    if tx.send(Bytes::from(format!("{line}\n"))).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    _ = &mut notified => {}
                    _ = stop.changed() => return,
                    _ = tx.closed() => return,
                }
            }
        });
        let body = StreamBody::new(
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|b| (b, rx)) },
            )
            .map(|b| Ok::<_, Infallible>(Frame::data(b))),
        );
        let mut r = http::Response::new(BodyExt::boxed(body));
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        return r;
    }
    let body = StreamBody::new(
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) })
            .map(|b| Ok::<_, Infallible>(Frame::data(b))),
    );
    http::Response::new(BodyExt::boxed(body))
}
