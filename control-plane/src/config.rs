//! Configuration: YAML file, parsed with serde (`deny_unknown_fields`), then validated into
//! [`Config`] with errors that name the field (`pools[0].endpoints[2].metrics_url`).
//!
//! Defaults and why:
//! - `scrape.interval_ms` 200: vLLM's KV gauge moves within a few decode steps; 200 ms is
//!   the refresh the issue asks for and keeps one request/s per endpoint × 5 cheap.
//! - `scrape.timeout_ms` 500: a stat older than a few intervals is no longer useful for
//!   routing, and each endpoint has its own task, so a slow one only delays itself.
//! - `scrape.jitter` 0.1: each wait is `interval × (1 + U(0, jitter))`, so endpoints drift
//!   apart instead of being scraped in lock-step.
//! - `push.heartbeat_ms` 1000: the filter sees a fresh snapshot at least every second even
//!   when nothing changed.
//! - `push.min_interval_ms` 10: changes arriving within 10 ms are coalesced into one push
//!   (large snapshots widen the window: [`crate::hub::coalesce_window`]).
//! - `push.backoff_initial_ms` 100, `push.backoff_max_ms` 5000: exponential retry per target.
//! - `push.token_env` `KVROUTE_INGEST_TOKEN`, `scrape.token_*` unset: the ingest always takes
//!   a token, while most model servers take none; a llama-server started with `--api-key`
//!   answers 401 on `/metrics` and `/slots` without one. Both sections read their bearer
//!   token the same way ([`TokenSettings`]). A pool's own `scrape_token_file` /
//!   `scrape_token_env` replaces `scrape.token_*` for its endpoints, so a key goes only to
//!   the model servers that asked for it.

use crate::adapters::ServerKind;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Environment variable read for the ingest bearer token when `push.token_env` is not set.
pub const DEFAULT_TOKEN_ENV: &str = "KVROUTE_INGEST_TOKEN";

/// The config file as written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Address of kvroute-cp's own HTTP server (`/healthz`, `/readyz`, `/metrics`,
    /// `/v1/snapshot`). Default `127.0.0.1:9090`.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Scrape settings.
    #[serde(default)]
    pub scrape: RawScrape,
    /// Push settings.
    #[serde(default)]
    pub push: RawPush,
    /// Envoy ingest targets.
    #[serde(default)]
    pub targets: Vec<RawTarget>,
    /// Static discovery: pools of endpoints.
    #[serde(default)]
    pub pools: Vec<RawPool>,
    /// Kubernetes discovery: InferencePools (endpoints) and gateway pods (push targets).
    #[serde(default)]
    pub kubernetes: RawKubernetes,
}

fn default_listen() -> String {
    "127.0.0.1:9090".into()
}

/// `scrape:` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawScrape {
    /// Milliseconds between scrapes of one endpoint (default 200, 10..=60000).
    pub interval_ms: u64,
    /// Milliseconds one scrape may take, connect to last byte (default 500, 1..=60000).
    pub timeout_ms: u64,
    /// Extra random wait, as a fraction of the interval (default 0.1, 0..=1).
    pub jitter: f64,
    /// Largest `/metrics` body read, bytes (default 8 MiB).
    pub max_body_bytes: usize,
    /// TLS for `https://` metrics URLs.
    pub tls: RawTls,
    /// File holding the bearer token sent with every scrape (surrounding whitespace trimmed),
    /// e.g. llama-server's `--api-key`. Wins over `token_env`.
    pub token_file: Option<PathBuf>,
    /// Environment variable holding the scrape bearer token (surrounding whitespace
    /// trimmed; no default: with neither field set, scrapes carry no `Authorization`).
    pub token_env: Option<String>,
}

/// `tls:` of `scrape` or `push`: used for `https://` URLs only.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawTls {
    /// PEM bundle of the CAs to trust; default the system trust store.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain (mTLS); needs `key_file`.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<PathBuf>,
}

/// Validated TLS file settings (read by [`crate::tls::client_config`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsSettings {
    /// CA bundle.
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain.
    pub cert_file: Option<PathBuf>,
    /// Client key.
    pub key_file: Option<PathBuf>,
}

impl RawTls {
    fn validate(&self, section: &str) -> Result<TlsSettings, ConfigError> {
        match (&self.cert_file, &self.key_file) {
            (Some(c), None) => {
                return Err(invalid(
                    format!("{section}.cert_file"),
                    c.display(),
                    "needs key_file too",
                ))
            }
            (None, Some(k)) => {
                return Err(invalid(
                    format!("{section}.key_file"),
                    k.display(),
                    "needs cert_file too",
                ))
            }
            _ => {}
        }
        Ok(TlsSettings {
            ca_file: self.ca_file.clone(),
            cert_file: self.cert_file.clone(),
            key_file: self.key_file.clone(),
        })
    }
}

impl Default for RawScrape {
    fn default() -> Self {
        Self {
            interval_ms: 200,
            timeout_ms: 500,
            jitter: 0.1,
            max_body_bytes: 8 << 20,
            tls: RawTls::default(),
            token_file: None,
            token_env: None,
        }
    }
}

/// `push:` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawPush {
    /// Push the current snapshot at least this often, ms (default 1000, 50..=60000).
    pub heartbeat_ms: u64,
    /// Coalescing window for changes, ms (default 10, 0..=heartbeat).
    pub min_interval_ms: u64,
    /// Milliseconds one push may take (default 1000).
    pub timeout_ms: u64,
    /// First retry delay after a failed push, ms (default 100).
    pub backoff_initial_ms: u64,
    /// Longest retry delay, ms (default 5000).
    pub backoff_max_ms: u64,
    /// File holding the bearer token (surrounding whitespace trimmed). Wins over `token_env`.
    pub token_file: Option<PathBuf>,
    /// Environment variable holding the bearer token (default `KVROUTE_INGEST_TOKEN`;
    /// surrounding whitespace trimmed, as for the file).
    pub token_env: Option<String>,
    /// TLS for `https://` ingest URLs.
    pub tls: RawTls,
    /// Reading each gateway's in-flight stats to share load between gateways.
    pub peer_load: RawPeerLoad,
}

/// `push.peer_load:` section: how often each gateway's Envoy stats are read, and how long a
/// reading counts ([`crate::peers`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawPeerLoad {
    /// Time between two reads of one gateway's stats, ms (default 200, 10..=60000).
    pub interval_ms: u64,
    /// One read, connect to last byte, ms (default 500, 1..=60000).
    pub timeout_ms: u64,
    /// A gateway's last reading is dropped this long after it was taken, ms (default 2000,
    /// at least `interval_ms`).
    pub stale_after_ms: u64,
}

impl Default for RawPeerLoad {
    fn default() -> Self {
        Self {
            interval_ms: 200,
            timeout_ms: 500,
            stale_after_ms: 2000,
        }
    }
}

impl Default for RawPush {
    fn default() -> Self {
        Self {
            heartbeat_ms: 1000,
            min_interval_ms: 10,
            timeout_ms: 1000,
            backoff_initial_ms: 100,
            backoff_max_ms: 5000,
            token_file: None,
            token_env: None,
            tls: RawTls::default(),
            peer_load: RawPeerLoad::default(),
        }
    }
}

/// One Envoy ingest target.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTarget {
    /// Name used in logs and metric labels; unique.
    pub name: String,
    /// Full ingest URL, `http://host:port/kvroute/v1/snapshot`.
    pub url: String,
    /// Envoy stats URL of this gateway in the Prometheus text format, e.g.
    /// `http://host:9901/stats/prometheus?filter=inflight_unseen` (admin; the `filter` regex
    /// keeps only the kvroute in-flight gauges) or the same path on `host:15090` (Istio). Unset: this gateway's in-flight load is not read (it still receives the
    /// other gateways' load).
    #[serde(default)]
    pub stats_url: Option<String>,
}

/// `kubernetes:` section. Empty by default (no Kubernetes API access at all).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawKubernetes {
    /// API server URL, e.g. `https://10.0.0.1:6443`. Default: in-cluster service-account
    /// config, else `$KUBECONFIG`/`~/.kube/config` (kube-rs `Config::infer`).
    pub api_server: Option<String>,
    /// InferencePools whose ready pods become endpoints.
    pub inference_pools: Vec<RawInferencePool>,
    /// Gateway pods that each get every snapshot pushed to them.
    pub gateways: Vec<RawGateways>,
}

/// One watched InferencePool (`inference.networking.k8s.io/v1`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawInferencePool {
    /// Namespace of the InferencePool (its pods live there too).
    pub namespace: String,
    /// InferencePool name; also the snapshot's pool name.
    pub name: String,
    /// Server kind of the pool's pods (default `auto`).
    #[serde(default)]
    pub kind: ServerKind,
    /// Envoy cluster reaching the pool's pods; default the pool name.
    pub cluster: Option<String>,
    /// Models served; default: each pod's `GET /v1/models` (`data[].id`).
    #[serde(default)]
    pub models: Vec<String>,
    /// Port serving `/metrics`; default each target port.
    pub metrics_port: Option<u16>,
    /// Path of the metrics endpoint (default `/metrics`).
    #[serde(default = "default_metrics_path")]
    pub metrics_path: String,
    /// `http` or `https` for scrapes and `/v1/models` (default `http`).
    #[serde(default = "default_scheme")]
    pub scheme: String,
    /// File holding this pool's scrape bearer token (`/metrics`, `/slots`, `/v1/models`),
    /// instead of `scrape.token_*`. Wins over `scrape_token_env`.
    #[serde(default)]
    pub scrape_token_file: Option<PathBuf>,
    /// Environment variable holding this pool's scrape bearer token, instead of
    /// `scrape.token_*`.
    #[serde(default)]
    pub scrape_token_env: Option<String>,
}

fn default_metrics_path() -> String {
    "/metrics".into()
}

fn default_scheme() -> String {
    "http".into()
}

fn default_ingest_path() -> String {
    "/kvroute/v1/snapshot".into()
}

/// Gateway (Envoy) pods selected by labels; every ready one becomes a push target.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGateways {
    /// Name prefix of the targets (`<name>/<pod>`), in logs and metric labels.
    pub name: String,
    /// Namespace of the gateway pods.
    pub namespace: String,
    /// Label selector (`matchLabels`), e.g. `{istio: ingressgateway}`; at least one label.
    pub selector: std::collections::BTreeMap<String, String>,
    /// Port of the ingest listener on each pod.
    pub port: u16,
    /// Ingest path (default `/kvroute/v1/snapshot`).
    #[serde(default = "default_ingest_path")]
    pub path: String,
    /// `http` or `https` (default `http`).
    #[serde(default = "default_scheme")]
    pub scheme: String,
    /// Read each pod's in-flight load from its Envoy stats (default true).
    #[serde(default = "default_true")]
    pub share_load: bool,
    /// Port of each pod's Envoy stats in the Prometheus format (default 15090, Istio's
    /// `/stats/prometheus` listener on the pod IP; Envoy's admin port elsewhere).
    #[serde(default = "default_stats_port")]
    pub stats_port: u16,
    /// Path of the stats (default `/stats/prometheus?filter=inflight_unseen`: Envoy's admin
    /// `filter` regex keeps only the kvroute in-flight gauges, a few hundred bytes instead
    /// of the whole stats page, 150 KB for a small Envoy in `integration/tests/cp_herd.rs`).
    #[serde(default = "default_stats_path")]
    pub stats_path: String,
}

fn default_true() -> bool {
    true
}

fn default_stats_port() -> u16 {
    15090
}

fn default_stats_path() -> String {
    "/stats/prometheus?filter=inflight_unseen".into()
}

/// One pool (InferencePool).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPool {
    /// Pool name; unique.
    pub name: String,
    /// Default server kind for the pool's endpoints (default `auto`).
    #[serde(default)]
    pub kind: ServerKind,
    /// Default models for the pool's endpoints.
    #[serde(default)]
    pub models: Vec<String>,
    /// Endpoints (model-server replicas).
    pub endpoints: Vec<RawEndpoint>,
    /// File holding this pool's scrape bearer token, instead of `scrape.token_*`. Wins
    /// over `scrape_token_env`.
    #[serde(default)]
    pub scrape_token_file: Option<PathBuf>,
    /// Environment variable holding this pool's scrape bearer token, instead of
    /// `scrape.token_*`.
    #[serde(default)]
    pub scrape_token_env: Option<String>,
}

/// One model-server endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEndpoint {
    /// Name, unique in the pool; the snapshot id is `<pool>/<name>`.
    pub name: String,
    /// Serving address `host:port` the filter routes to.
    pub address: String,
    /// Prometheus URL; default `http://<address>/metrics`.
    pub metrics_url: Option<String>,
    /// Envoy cluster reaching this endpoint; default `<pool>`.
    pub cluster: Option<String>,
    /// Server kind; default the pool's.
    pub kind: Option<ServerKind>,
    /// Models served; default the pool's.
    pub models: Option<Vec<String>>,
    /// llama.cpp only: slots URL; default the metrics URL with path `/slots`.
    pub slots_url: Option<String>,
}

/// A validated, defaulted configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Own HTTP listen address.
    pub listen: SocketAddr,
    /// Scrape settings.
    pub scrape: ScrapeSettings,
    /// Push settings.
    pub push: PushSettings,
    /// Ingest targets.
    pub targets: Vec<Target>,
    /// Endpoints across all pools, in config order.
    pub endpoints: Vec<EndpointSpec>,
    /// Kubernetes discovery.
    pub kubernetes: KubernetesSettings,
    /// Every configured pool by name (`pools[]` and `kubernetes.inference_pools[]`; names
    /// are unique across both) with the models the config says it serves: `pools[].models`
    /// (the endpoints' default) and `kubernetes.inference_pools[].models` (empty: read from
    /// the pods). The hub names the models of a pool without endpoints in the snapshot's
    /// `unavailable_models` ([`crate::hub::Hub::set_pools`]).
    pub pool_models: BTreeMap<String, Vec<String>>,
}

/// Validated `kubernetes:` section.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KubernetesSettings {
    /// API server override.
    pub api_server: Option<http::Uri>,
    /// Watched InferencePools.
    pub pools: Vec<PoolWatch>,
    /// Watched gateway pod sets.
    pub gateways: Vec<GatewayWatch>,
}

impl KubernetesSettings {
    /// True when nothing is watched (no API client is built).
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty() && self.gateways.is_empty()
    }
}

/// A validated InferencePool watch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolWatch {
    /// Namespace.
    pub namespace: String,
    /// InferencePool name.
    pub name: String,
    /// Server kind.
    pub kind: ServerKind,
    /// Envoy cluster.
    pub cluster: String,
    /// Models (empty: ask each pod's `/v1/models`).
    pub models: Vec<String>,
    /// Metrics port override.
    pub metrics_port: Option<u16>,
    /// Metrics path (starts with `/`).
    pub metrics_path: String,
    /// `http` or `https`.
    pub scheme: String,
}

/// A validated gateway pod watch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GatewayWatch {
    /// Target name prefix.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// `matchLabels`.
    pub selector: std::collections::BTreeMap<String, String>,
    /// Ingest port.
    pub port: u16,
    /// Ingest path (starts with `/`).
    pub path: String,
    /// `http` or `https`.
    pub scheme: String,
    /// Stats port and path of each pod (same scheme), when load is shared.
    pub stats: Option<(u16, String)>,
}

/// Validated scrape settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ScrapeSettings {
    /// Interval between scrapes.
    pub interval: Duration,
    /// Per-scrape timeout.
    pub timeout: Duration,
    /// Jitter fraction 0..=1.
    pub jitter: f64,
    /// Body size limit, bytes.
    pub max_body_bytes: usize,
    /// TLS files for `https://`.
    pub tls: TlsSettings,
    /// Scrape token file (`scrape.token_file`).
    pub token_file: Option<PathBuf>,
    /// Scrape token env var name (`scrape.token_env`); `None`: no variable is read.
    pub token_env: Option<String>,
    /// Pools with their own scrape token (`pools[].scrape_token_*`,
    /// `kubernetes.inference_pools[].scrape_token_*`), by pool name: their endpoints get it
    /// instead of [`Self::token`]'s ([`Self::token_for`]).
    pub pool_tokens: BTreeMap<String, TokenSettings>,
}

/// Validated push settings.
#[derive(Debug, Clone, PartialEq)]
pub struct PushSettings {
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// Coalescing window.
    pub min_interval: Duration,
    /// Per-push timeout.
    pub timeout: Duration,
    /// First retry delay.
    pub backoff_initial: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// Token file.
    pub token_file: Option<PathBuf>,
    /// Token env var name.
    pub token_env: String,
    /// TLS files for `https://`.
    pub tls: TlsSettings,
    /// Reading the gateways' in-flight stats.
    pub peer_load: PeerLoadSettings,
}

/// Validated `push.peer_load` settings.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerLoadSettings {
    /// Time between two reads of one gateway's stats.
    pub interval: Duration,
    /// One read.
    pub timeout: Duration,
    /// Age after which a gateway's last reading is dropped.
    pub stale_after: Duration,
}

/// A validated ingest target.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// Name.
    pub name: String,
    /// Ingest URL.
    pub url: http::Uri,
    /// Envoy stats URL (Prometheus text) whose in-flight gauges are shared with the other
    /// gateways; `None`: not read.
    pub stats_url: Option<http::Uri>,
}

/// A validated endpoint (what discovery yields).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EndpointSpec {
    /// Snapshot id `<pool>/<name>`.
    pub id: String,
    /// Pool name.
    pub pool: String,
    /// Serving address.
    pub address: String,
    /// Metrics URL.
    pub metrics_url: http::Uri,
    /// llama.cpp slots URL.
    pub slots_url: Option<http::Uri>,
    /// Envoy cluster.
    pub cluster: String,
    /// Server kind.
    pub kind: ServerKind,
    /// Models.
    pub models: Vec<String>,
}

/// A configuration error that names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {reason}")]
    Read {
        /// Path.
        path: String,
        /// OS error.
        reason: String,
    },
    /// Not valid YAML for the schema (unknown field, wrong type); serde names the field and line.
    #[error("config: {0}")]
    Syntax(String),
    /// A field's value is invalid.
    #[error("config field `{field}` = `{value}`: {reason}")]
    Invalid {
        /// Field path, e.g. `pools[0].endpoints[2].metrics_url`.
        field: String,
        /// The offending value.
        value: String,
        /// Why.
        reason: String,
    },
}

/// Why a name with a control character is refused: kvroute-core's `Snapshot::validate`
/// rejects the whole snapshot for one such string (they end up in request headers).
const CONTROL_REASON: &str = "must not contain control characters (CR, LF, NUL...)";

/// Why a name over kvroute-core's `MAX_LABEL_BYTES` is refused: one that reaches a
/// snapshot would make every filter reject every snapshot (gateway names, which do not,
/// are metric labels and bounded alike).
const LONG_REASON: &str = "must be at most 1024 bytes";

/// Why `s` cannot go into a snapshot as a name (kvroute-core's `check_label`), or `None`:
/// [`LONG_REASON`] when it is too long, else `control` when it holds an ASCII or Unicode
/// control character, or when it is empty and `empty_ok` is false (the callers whose
/// message names both).
fn label_problem(s: &str, empty_ok: bool, control: &'static str) -> Option<&'static str> {
    if s.len() > kvroute_core::snapshot::MAX_LABEL_BYTES {
        Some(LONG_REASON)
    } else if (s.is_empty() && !empty_ok) || kvroute_core::snapshot::check_label(s).is_err() {
        Some(control)
    } else {
        None
    }
}

/// Why a list of model names is refused: one is empty or holds a control character.
const MODEL_REASON: &str = "model names must be non-empty without control characters";

/// The first of `names` that cannot go into a snapshot, with why ([`label_problem`]; an
/// empty name is refused with `control`).
fn first_problem<'a>(
    names: &'a [String],
    control: &'static str,
) -> Option<(&'a String, &'static str)> {
    names
        .iter()
        .find_map(|m| label_problem(m, false, control).map(|r| (m, r)))
}

/// Most a config may expand to, bytes: its scalars' bytes plus [`NODE_BYTES`] per node,
/// with YAML aliases repeating what they name (64 MiB; 20,000 static endpoints come to a few
/// MB). A 1.1 MB file aliasing a 1 MiB string 20,000 times expanded to 20 GB in parsing
/// (21.8 GB peak, found by a breaker, 2026-12-05): serde_yaml_ng bounds alias jumps by
/// event count, not by bytes.
pub const MAX_EXPANDED_BYTES: u64 = 64 * 1024 * 1024;
/// What each node (scalar, sequence, mapping) counts toward [`MAX_EXPANDED_BYTES`] besides
/// its text.
const NODE_BYTES: u64 = 16;

/// Walk `text` as YAML, aliases followed, without building anything, and refuse it when it
/// expands past [`MAX_EXPANDED_BYTES`]. Syntax errors are left to the real parse.
fn check_expanded_size(text: &str) -> Result<(), ConfigError> {
    use serde::de::{DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, Visitor};
    use std::cell::Cell;
    use std::fmt;

    #[derive(Clone, Copy)]
    struct Measure<'a>(&'a Cell<u64>);

    impl Measure<'_> {
        fn add<E: serde::de::Error>(self, n: u64) -> Result<(), E> {
            let total = self.0.get().saturating_add(n).saturating_add(NODE_BYTES);
            self.0.set(total);
            if total > MAX_EXPANDED_BYTES {
                return Err(E::custom(format!(
                    "the config expands to more than {MAX_EXPANDED_BYTES} bytes (YAML aliases \
                     repeating large nodes?)"
                )));
            }
            Ok(())
        }
    }

    impl<'de> DeserializeSeed<'de> for Measure<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Measure<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any YAML")
        }
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
            self.add(0)
        }
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
            self.add(0)
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
            self.add(0)
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
            self.add(0)
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
            self.add(v.len() as u64)
        }
        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<(), E> {
            self.add(v.len() as u64)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
            self.add(0)
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<(), E> {
            self.add(0)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
        fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            self.add(0)?;
            while seq.next_element_seed(self)?.is_some() {}
            Ok(())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            self.add(0)?;
            while map.next_key_seed(self)?.is_some() {
                map.next_value_seed(self)?;
            }
            Ok(())
        }
        fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
            use serde::de::VariantAccess;
            let ((), v) = data.variant_seed(self)?;
            v.newtype_variant_seed(self)
        }
    }

    let total = Cell::new(0);
    match Measure(&total).deserialize(serde_yaml_ng::Deserializer::from_str(text)) {
        Err(e) if total.get() > MAX_EXPANDED_BYTES => Err(ConfigError::Syntax(e.to_string())),
        _ => Ok(()),
    }
}

/// Longest value echoed whole in a [`ConfigError::Invalid`] (4 KiB): a 1 MB value was
/// logged as one 1 MB line on a rejected reload (found by a breaker, 2026-12-05). Past it
/// the value is cut at a character boundary and its length given
/// ([`kvroute_core::echo::echo_within`]).
pub const MAX_ERROR_VALUE_BYTES: usize = 4096;

fn invalid(
    field: impl Into<String>,
    value: impl ToString,
    reason: impl Into<String>,
) -> ConfigError {
    let value = value.to_string();
    ConfigError::Invalid {
        field: field.into(),
        value: kvroute_core::echo::echo_within(&value, MAX_ERROR_VALUE_BYTES).into_owned(),
        reason: reason.into(),
    }
}

/// Parse an `http://` or `https://` `host:port/...` URL.
fn http_url(field: &str, s: &str) -> Result<http::Uri, ConfigError> {
    let uri: http::Uri = s
        .parse()
        .map_err(|e: http::uri::InvalidUri| invalid(field, s, format!("not a URL ({e})")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(invalid(field, s, "must start with http:// or https://"));
    }
    let Some(authority) = uri.authority() else {
        return Err(invalid(field, s, "has no host"));
    };
    if !port_ok(authority) {
        return Err(invalid(field, s, PORT_REASON));
    }
    Ok(uri)
}

/// Why a URL with a bad port is refused: [`http::Uri::port_u16`] is `None` for a port
/// that is not a number in 0..=65535, and hyper would then silently use the scheme's
/// default port (80 or 443).
const PORT_REASON: &str = "has an invalid port (expected 1..=65535)";

/// Whether `authority`'s port, when one is written (`host:port`, `[v6]:port`), is a
/// number in 1..=65535. No port at all is fine (the scheme's default); an empty one
/// (`host:`) is not.
fn port_ok(authority: &http::uri::Authority) -> bool {
    let a = authority.as_str();
    let host_port = a.rsplit_once('@').map_or(a, |(_, hp)| hp);
    if host_port.ends_with(']') {
        return true;
    }
    match host_port.rsplit_once(':') {
        None => true,
        Some((_, port)) => port.parse::<u16>().is_ok_and(|p| p != 0),
    }
}

fn in_range(field: &str, v: u64, lo: u64, hi: u64) -> Result<Duration, ConfigError> {
    if v < lo || v > hi {
        return Err(invalid(field, v, format!("must be in {lo}..={hi} ms")));
    }
    Ok(Duration::from_millis(v))
}

impl Config {
    /// Parse and validate YAML text. An empty (or all-whitespace) text is an error.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_raw(text).map(|(_, c)| c)
    }

    /// Read, parse and validate a file.
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        Self::load_raw(path).map(|(_, c)| c)
    }

    /// Like [`Self::load`], also returning the file as written (for `--check`).
    pub fn load_raw(path: &std::path::Path) -> Result<(RawConfig, Self), ConfigError> {
        let text =
            crate::files::read_regular_text(path, crate::files::MAX_CONFIG_BYTES).map_err(|e| {
                ConfigError::Read {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                }
            })?;
        Self::from_yaml_raw(&text)
    }

    /// Like [`Self::from_yaml`], also returning the file as written.
    pub fn from_yaml_raw(text: &str) -> Result<(RawConfig, Self), ConfigError> {
        if text.trim().is_empty() {
            // A truncated file must not reload as "no endpoints".
            return Err(ConfigError::Syntax("the config is empty".into()));
        }
        check_expanded_size(text)?;
        let raw: RawConfig =
            serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        let c = raw.validate()?;
        Ok((raw, c))
    }
}

impl RawConfig {
    /// Validate and apply defaults.
    pub fn validate(&self) -> Result<Config, ConfigError> {
        let listen: SocketAddr = self
            .listen
            .parse()
            .map_err(|_| invalid("listen", &self.listen, "not an ip:port socket address"))?;
        let s = &self.scrape;
        let interval = in_range("scrape.interval_ms", s.interval_ms, 10, 60_000)?;
        let timeout = in_range("scrape.timeout_ms", s.timeout_ms, 1, 60_000)?;
        if !(0.0..=1.0).contains(&s.jitter) {
            return Err(invalid(
                "scrape.jitter",
                s.jitter,
                "must be a ratio in 0..=1",
            ));
        }
        if s.max_body_bytes < 1024 {
            return Err(invalid(
                "scrape.max_body_bytes",
                s.max_body_bytes,
                "must be at least 1024",
            ));
        }
        let p = &self.push;
        let heartbeat = in_range("push.heartbeat_ms", p.heartbeat_ms, 50, 60_000)?;
        let min_interval = in_range("push.min_interval_ms", p.min_interval_ms, 0, p.heartbeat_ms)?;
        let push_timeout = in_range("push.timeout_ms", p.timeout_ms, 1, 60_000)?;
        let backoff_initial = in_range("push.backoff_initial_ms", p.backoff_initial_ms, 1, 60_000)?;
        let backoff_max = in_range(
            "push.backoff_max_ms",
            p.backoff_max_ms,
            p.backoff_initial_ms,
            600_000,
        )?;
        TokenFor::Scrape.check_env(s.token_env.as_deref())?;
        TokenFor::Push.check_env(p.token_env.as_deref())?;
        let pl = &p.peer_load;
        let peer_interval = in_range("push.peer_load.interval_ms", pl.interval_ms, 10, 60_000)?;
        let peer_timeout = in_range("push.peer_load.timeout_ms", pl.timeout_ms, 1, 60_000)?;
        let peer_stale = in_range(
            "push.peer_load.stale_after_ms",
            pl.stale_after_ms,
            pl.interval_ms,
            600_000,
        )?;
        let mut names = BTreeSet::new();
        let mut targets = Vec::new();
        for (i, t) in self.targets.iter().enumerate() {
            if t.name.is_empty() {
                return Err(invalid(
                    format!("targets[{i}].name"),
                    "",
                    "must not be empty",
                ));
            }
            if !names.insert(t.name.as_str()) {
                return Err(invalid(
                    format!("targets[{i}].name"),
                    &t.name,
                    "duplicate target name",
                ));
            }
            let url = http_url(&format!("targets[{i}].url"), &t.url)?;
            let stats_url = match &t.stats_url {
                Some(s) => Some(http_url(&format!("targets[{i}].stats_url"), s)?),
                None => None,
            };
            targets.push(Target {
                name: t.name.clone(),
                url,
                stats_url,
            });
        }
        let mut pools = BTreeSet::new();
        let mut endpoints = Vec::new();
        for (pi, pool) in self.pools.iter().enumerate() {
            if let Some(reason) = label_problem(&pool.name, true, CONTROL_REASON) {
                return Err(invalid(
                    format!("pools[{pi}].name"),
                    pool.name.escape_debug(),
                    reason,
                ));
            }
            if pool.name.is_empty() || pool.name.contains('/') {
                return Err(invalid(
                    format!("pools[{pi}].name"),
                    &pool.name,
                    "must be non-empty and contain no `/`",
                ));
            }
            if !pools.insert(pool.name.as_str()) {
                return Err(invalid(
                    format!("pools[{pi}].name"),
                    &pool.name,
                    "duplicate pool name",
                ));
            }
            // Checked before the endpoints, so that a bad pool-level name is reported as
            // `pools[i].models` whether or not endpoints inherit it, and also for a pool
            // whose endpoints all name their own models (or that has none): these names
            // reach the snapshot's `unavailable_models`.
            if let Some((m, reason)) = first_problem(&pool.models, MODEL_REASON) {
                return Err(invalid(
                    format!("pools[{pi}].models"),
                    m.escape_debug(),
                    reason,
                ));
            }
            let mut eps = BTreeSet::new();
            for (ei, e) in pool.endpoints.iter().enumerate() {
                let at = |f: &str| format!("pools[{pi}].endpoints[{ei}].{f}");
                if e.name.is_empty() {
                    return Err(invalid(at("name"), "", "must not be empty"));
                }
                if let Some(reason) = label_problem(&e.name, true, CONTROL_REASON) {
                    return Err(invalid(at("name"), e.name.escape_debug(), reason));
                }
                // The endpoint's id is `pool/name`: bounded like each part.
                let id = format!("{}/{}", pool.name, e.name);
                if id.len() > kvroute_core::snapshot::MAX_LABEL_BYTES {
                    return Err(invalid(
                        at("name"),
                        &e.name,
                        "with the pool's name and a `/` (the endpoint's id) must be at most 1024 bytes",
                    ));
                }
                if !eps.insert(e.name.as_str()) {
                    return Err(invalid(
                        at("name"),
                        &e.name,
                        "duplicate endpoint name in this pool",
                    ));
                }
                let addr: http::uri::Authority = e
                    .address
                    .parse()
                    .map_err(|_| invalid(at("address"), &e.address, "not a host:port address"))?;
                if addr.port_u16().is_none() {
                    return Err(invalid(at("address"), &e.address, "has no port"));
                }
                // The filter rejects a whole snapshot with one bad address (port 0,
                // userinfo...), so apply kvroute-core's own check here.
                if let Err(reason) = kvroute_core::snapshot::check_address(&e.address) {
                    return Err(invalid(at("address"), e.address.escape_debug(), reason));
                }
                let metrics_raw = e
                    .metrics_url
                    .clone()
                    .unwrap_or_else(|| format!("http://{}/metrics", e.address));
                let metrics_url = http_url(&at("metrics_url"), &metrics_raw)?;
                let kind = e.kind.unwrap_or(pool.kind);
                let slots_url = match (&e.slots_url, kind) {
                    (Some(s), _) => Some(http_url(&at("slots_url"), s)?),
                    (None, ServerKind::Llamacpp | ServerKind::Auto) => {
                        let authority = metrics_url
                            .authority()
                            .map(|a| a.as_str().to_owned())
                            .unwrap_or_default();
                        Some(http_url(
                            &at("slots_url"),
                            &format!(
                                "{}://{authority}/slots",
                                metrics_url.scheme_str().unwrap_or("http")
                            ),
                        )?)
                    }
                    (None, _) => None,
                };
                let models = e.models.clone().unwrap_or_else(|| pool.models.clone());
                if let Some(m) = models.iter().find(|m| m.is_empty()) {
                    return Err(invalid(at("models"), m, "model names must not be empty"));
                }
                if let Some((m, reason)) = first_problem(&models, CONTROL_REASON) {
                    return Err(invalid(at("models"), m.escape_debug(), reason));
                }
                let cluster = e.cluster.clone().unwrap_or_else(|| pool.name.clone());
                if cluster.is_empty() {
                    return Err(invalid(at("cluster"), "", "must not be empty"));
                }
                if let Some(reason) = label_problem(&cluster, true, CONTROL_REASON) {
                    return Err(invalid(at("cluster"), cluster.escape_debug(), reason));
                }
                endpoints.push(EndpointSpec {
                    id,
                    pool: pool.name.clone(),
                    address: e.address.clone(),
                    metrics_url,
                    slots_url,
                    cluster,
                    kind,
                    models,
                });
            }
        }
        let mut pool_models = BTreeMap::new();
        let mut pool_tokens = BTreeMap::new();
        for (pi, pool) in self.pools.iter().enumerate() {
            pool_models.insert(pool.name.clone(), pool.models.clone());
            if let Some(t) = pool_token(
                format!("pools[{pi}]"),
                &pool.scrape_token_file,
                &pool.scrape_token_env,
            )? {
                pool_tokens.insert(pool.name.clone(), t);
            }
        }
        let kubernetes = self.kubernetes.validate(&pools)?;
        for p in &kubernetes.pools {
            pool_models.insert(p.name.clone(), p.models.clone());
        }
        // `kubernetes.pools` are the watched pools validated, in the file's order.
        for (i, (w, p)) in kubernetes
            .pools
            .iter()
            .zip(&self.kubernetes.inference_pools)
            .enumerate()
        {
            if let Some(t) = pool_token(
                format!("kubernetes.inference_pools[{i}]"),
                &p.scrape_token_file,
                &p.scrape_token_env,
            )? {
                pool_tokens.insert(w.name.clone(), t);
            }
        }
        Ok(Config {
            kubernetes,
            pool_models,
            listen,
            scrape: ScrapeSettings {
                interval,
                timeout,
                jitter: s.jitter,
                max_body_bytes: s.max_body_bytes,
                tls: s.tls.validate("scrape.tls")?,
                token_file: s.token_file.clone(),
                token_env: s.token_env.clone(),
                pool_tokens,
            },
            push: PushSettings {
                heartbeat,
                min_interval,
                timeout: push_timeout,
                backoff_initial,
                backoff_max,
                token_file: p.token_file.clone(),
                token_env: p
                    .token_env
                    .clone()
                    .unwrap_or_else(|| DEFAULT_TOKEN_ENV.into()),
                tls: p.tls.validate("push.tls")?,
                peer_load: PeerLoadSettings {
                    interval: peer_interval,
                    timeout: peer_timeout,
                    stale_after: peer_stale,
                },
            },
            targets,
            endpoints,
        })
    }
}

fn scheme(field: &str, s: &str) -> Result<String, ConfigError> {
    match s {
        "http" | "https" => Ok(s.to_owned()),
        _ => Err(invalid(field, s, "must be `http` or `https`")),
    }
}

fn url_path(field: &str, s: &str) -> Result<String, ConfigError> {
    if !s.starts_with('/') || s.parse::<http::uri::PathAndQuery>().is_err() {
        return Err(invalid(field, s, "must be a URL path starting with `/`"));
    }
    Ok(s.to_owned())
}

/// A Kubernetes object name or namespace (RFC 1123 label/subdomain characters).
fn k8s_name(field: &str, s: &str) -> Result<String, ConfigError> {
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    if !ok {
        return Err(invalid(
            field,
            s.escape_debug(),
            "must be a Kubernetes name (lower-case letters, digits, `-`, `.`)",
        ));
    }
    Ok(s.to_owned())
}

impl RawKubernetes {
    /// Validate; `static_pools` are the names used by `pools:` (a name may not be both).
    fn validate(&self, static_pools: &BTreeSet<&str>) -> Result<KubernetesSettings, ConfigError> {
        let api_server = match &self.api_server {
            None => None,
            Some(s) => {
                let uri: http::Uri = s.parse().map_err(|e: http::uri::InvalidUri| {
                    invalid("kubernetes.api_server", s, format!("not a URL ({e})"))
                })?;
                if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none()
                {
                    return Err(invalid(
                        "kubernetes.api_server",
                        s,
                        "must be an http:// or https:// URL with a host",
                    ));
                }
                if uri.authority().is_some_and(|a| !port_ok(a)) {
                    return Err(invalid("kubernetes.api_server", s, PORT_REASON));
                }
                Some(uri)
            }
        };
        let mut names = BTreeSet::new();
        let mut pools = Vec::new();
        for (i, p) in self.inference_pools.iter().enumerate() {
            let at = |f: &str| format!("kubernetes.inference_pools[{i}].{f}");
            let namespace = k8s_name(&at("namespace"), &p.namespace)?;
            let name = k8s_name(&at("name"), &p.name)?;
            if static_pools.contains(name.as_str()) || !names.insert(name.clone()) {
                return Err(invalid(
                    at("name"),
                    &name,
                    "duplicate pool name (pool names are unique across `pools` and `kubernetes.inference_pools`)",
                ));
            }
            let cluster = p.cluster.clone().unwrap_or_else(|| name.clone());
            if let Some(reason) = label_problem(
                &cluster,
                false,
                "must be non-empty without control characters",
            ) {
                return Err(invalid(at("cluster"), cluster.escape_debug(), reason));
            }
            if let Some((m, reason)) = first_problem(&p.models, MODEL_REASON) {
                return Err(invalid(at("models"), m.escape_debug(), reason));
            }
            if p.metrics_port == Some(0) {
                return Err(invalid(at("metrics_port"), 0, "must be in 1..=65535"));
            }
            pools.push(PoolWatch {
                namespace,
                name,
                kind: p.kind,
                cluster,
                models: p.models.clone(),
                metrics_port: p.metrics_port,
                metrics_path: url_path(&at("metrics_path"), &p.metrics_path)?,
                scheme: scheme(&at("scheme"), &p.scheme)?,
            });
        }
        let mut gnames = BTreeSet::new();
        let mut gateways = Vec::new();
        for (i, g) in self.gateways.iter().enumerate() {
            let at = |f: &str| format!("kubernetes.gateways[{i}].{f}");
            const GATEWAY_REASON: &str = "must be non-empty, unique, without control characters";
            if let Some(reason) = label_problem(&g.name, false, GATEWAY_REASON) {
                return Err(invalid(at("name"), g.name.escape_debug(), reason));
            }
            if !gnames.insert(g.name.as_str()) {
                return Err(invalid(at("name"), g.name.escape_debug(), GATEWAY_REASON));
            }
            if g.selector.is_empty() {
                return Err(invalid(
                    at("selector"),
                    "{}",
                    "needs at least one label (an empty selector would push to every pod)",
                ));
            }
            if g.port == 0 {
                return Err(invalid(at("port"), 0, "must be in 1..=65535"));
            }
            if g.share_load && g.stats_port == 0 {
                return Err(invalid(at("stats_port"), 0, "must be in 1..=65535"));
            }
            let stats_path = url_path(&at("stats_path"), &g.stats_path)?;
            gateways.push(GatewayWatch {
                name: g.name.clone(),
                namespace: k8s_name(&at("namespace"), &g.namespace)?,
                selector: g.selector.clone(),
                port: g.port,
                path: url_path(&at("path"), &g.path)?,
                scheme: scheme(&at("scheme"), &g.scheme)?,
                stats: g.share_load.then_some((g.stats_port, stats_path)),
            });
        }
        Ok(KubernetesSettings {
            api_server,
            pools,
            gateways,
        })
    }
}

impl PushSettings {
    /// Where the ingest token comes from: `push.token_file`, else `push.token_env`.
    pub fn token(&self) -> TokenSettings {
        TokenSettings {
            section: TokenFor::Push,
            file: self.token_file.clone(),
            env: Some(self.token_env.clone()),
        }
    }

    /// Read the bearer token: `token_file` if set, else the env var (both trimmed);
    /// `Ok(None)` when neither holds one. Errors as [`TokenSettings::read`].
    pub fn read_token(&self) -> Result<Option<String>, ConfigError> {
        self.token().read()
    }

    /// Where the token is read from, for logs and `--check` (never the token itself):
    /// ``file `/etc/kvroute/token` `` or ``environment variable `KVROUTE_INGEST_TOKEN` ``.
    pub fn token_source(&self) -> String {
        self.token().source().unwrap_or_default()
    }
}

impl ScrapeSettings {
    /// Where the scrape token comes from: `scrape.token_file`, else `scrape.token_env`;
    /// neither set: no token ([`TokenSettings::is_set`] false).
    pub fn token(&self) -> TokenSettings {
        TokenSettings {
            section: TokenFor::Scrape,
            file: self.token_file.clone(),
            env: self.token_env.clone(),
        }
    }

    /// Where the scrape token of `pool`'s endpoints comes from: the pool's own settings
    /// when it has them ([`Self::pool_tokens`]), else [`Self::token`].
    pub fn token_for(&self, pool: &str) -> TokenSettings {
        self.pool_tokens
            .get(pool)
            .cloned()
            .unwrap_or_else(|| self.token())
    }
}

/// A pool's own scrape token settings (`<at>.scrape_token_file`, `<at>.scrape_token_env`,
/// `at` being `pools[0]` or `kubernetes.inference_pools[0]`); `None` when neither is set.
/// Errors: an empty variable name.
fn pool_token(
    at: String,
    file: &Option<PathBuf>,
    env: &Option<String>,
) -> Result<Option<TokenSettings>, ConfigError> {
    if file.is_none() && env.is_none() {
        return Ok(None);
    }
    let section = TokenFor::Pool { at };
    section.check_env(env.as_deref())?;
    Ok(Some(TokenSettings {
        section,
        file: file.clone(),
        env: env.clone(),
    }))
}

/// The config section a bearer token belongs to. It names the fields in errors, logs,
/// `--check` and the `source` label of `kvroute_cp_file_reload_failures_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TokenFor {
    /// The ingest token sent with every push (`push.token_file`, `push.token_env`).
    Push,
    /// The model servers' API key sent with every scrape (`scrape.token_file`,
    /// `scrape.token_env`).
    Scrape,
    /// One pool's own API key, sent with the scrapes of its endpoints instead of
    /// [`Self::Scrape`]'s: `at` is the pool's place in the file (`pools[1]`,
    /// `kubernetes.inference_pools[0]`), whose `scrape_token_file` and `scrape_token_env`
    /// hold it.
    Pool {
        /// `pools[i]` or `kubernetes.inference_pools[i]`.
        at: String,
    },
}

impl TokenFor {
    /// `push.token_file`, `scrape.token_file` or `pools[i].scrape_token_file`.
    pub fn file_field(&self) -> std::borrow::Cow<'static, str> {
        match self {
            Self::Push => "push.token_file".into(),
            Self::Scrape => "scrape.token_file".into(),
            Self::Pool { at } => format!("{at}.scrape_token_file").into(),
        }
    }

    /// `push.token_env`, `scrape.token_env` or `pools[i].scrape_token_env`.
    pub fn env_field(&self) -> std::borrow::Cow<'static, str> {
        match self {
            Self::Push => "push.token_env".into(),
            Self::Scrape => "scrape.token_env".into(),
            Self::Pool { at } => format!("{at}.scrape_token_env").into(),
        }
    }

    /// Refuse an empty variable name.
    fn check_env(&self, env: Option<&str>) -> Result<(), ConfigError> {
        match env {
            Some("") => Err(invalid(self.env_field(), "", "must not be empty")),
            _ => Ok(()),
        }
    }
}

/// Where one bearer token is read from: `file` (wins) or the environment variable `env`.
/// Read at start, on reload, by `--check`, and on every change of `file`
/// ([`crate::token::TokenSource`]); sent as `Authorization: Bearer <token>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TokenSettings {
    /// Section whose field names appear in errors.
    pub section: TokenFor,
    /// Token file (surrounding whitespace trimmed).
    pub file: Option<PathBuf>,
    /// Environment variable name; `None`: none is read.
    pub env: Option<String>,
}

impl TokenSettings {
    /// True when a file or a variable is configured (a token may still be absent).
    pub fn is_set(&self) -> bool {
        self.file.is_some() || self.env.is_some()
    }

    /// Read the token: `file` if set, else the variable, either trimmed of surrounding
    /// whitespace; `Ok(None)` when neither holds one (an unset or blank variable). Errors
    /// name the section's field and the file or variable: the file is unreadable or
    /// empty, or the token is not a valid header value (control character or line break
    /// inside).
    pub fn read(&self) -> Result<Option<String>, ConfigError> {
        let file_field = self.section.file_field();
        if let Some(path) = &self.file {
            let t = crate::files::read_regular_text(path, crate::files::MAX_TOKEN_BYTES)
                .map_err(|e| invalid(&*file_field, path.display(), format!("cannot read: {e}")))?;
            let Some(t) = trimmed_token(&t) else {
                return Err(invalid(&*file_field, path.display(), "file is empty"));
            };
            if !is_header_safe(&t) {
                return Err(invalid(&*file_field, path.display(), TOKEN_REASON));
            }
            return Ok(Some(t));
        }
        let Some(env) = &self.env else {
            return Ok(None);
        };
        let t = std::env::var(env).ok().and_then(|t| trimmed_token(&t));
        if t.as_deref().is_some_and(|t| !is_header_safe(t)) {
            return Err(invalid(self.section.env_field(), env, TOKEN_REASON));
        }
        Ok(t)
    }

    /// Where the token is read from, for logs and `--check` (never the token itself):
    /// ``file `/etc/kvroute/token` `` or ``environment variable `KVROUTE_INGEST_TOKEN` ``;
    /// `None` when neither is configured.
    pub fn source(&self) -> Option<String> {
        match (&self.file, &self.env) {
            (Some(p), _) => Some(format!("file `{}`", p.display())),
            (None, Some(e)) => Some(format!("environment variable `{e}`")),
            (None, None) => None,
        }
    }
}

/// A token as read from a file or a variable, with leading and trailing whitespace (a
/// trailing newline, stray spaces) removed, as the filter trims the token it receives;
/// `None` when nothing is left. Both sources go through here, so a token compares the
/// same wherever it was read from.
fn trimmed_token(raw: &str) -> Option<String> {
    let t = raw.trim();
    (!t.is_empty()).then(|| t.to_owned())
}

/// Why a token is refused: every request carrying it would otherwise fail to be built.
const TOKEN_REASON: &str =
    "token is not a valid HTTP header value (control character or line break inside)";

/// Whether `Bearer <token>` is a valid `Authorization` header value.
fn is_header_safe(token: &str) -> bool {
    http::HeaderValue::from_str(&crate::token::bearer(token)).is_ok()
}
