//! `kvroute-cp --check`: validate a config without starting, and say what it will do.
//!
//! Beyond parsing and validating ([`crate::config`]), the check reports what is otherwise
//! only visible at run time:
//! - whether an ingest token was found, and where from (never the token itself);
//! - with `scrape.token_file` or `scrape.token_env` set, the same for the scrape token, and
//!   for each pool with its own (`scrape_token_file`, `scrape_token_env`);
//! - which endpoints' Envoy `cluster` defaults to their pool's name (cluster mode routes to
//!   that cluster, so a missing Envoy cluster of that name is a 503 at request time);
//! - with an Envoy config (`--envoy-config`), a cross-check: every endpoint's cluster is
//!   defined when a kvroute filter runs in cluster mode; the ingest filter's
//!   `ingest_token`, when written inline, equals the token found; each target's port (the
//!   scheme's default when none is written: 80, or 443 for `https://`) is a listener port
//!   carrying the ingest filter, and its URL path that filter's `ingest_path` (else every
//!   push is answered 404).
//!
//! A kvroute filter is found in the Envoy config by its configuration, read as the filter
//! receives it (the string of a `google.protobuf.StringValue`, the bytes of a `BytesValue`;
//! any other type, `Struct` included, reaches the filter as protobuf and is refused): an
//! object with `role`, `mode` or `picker`, in any module; or any configuration, none
//! included, of a Wasm module whose file name says `kvroute`. Each is validated by the
//! filter's own code ([`kvroute_core::plugin_config`]). Without `role` it routes; without
//! `mode`, in cluster mode (the filter's defaults).
//!
//! Findings are [`Finding::Error`] (the check fails, exit 2) or [`Finding::Note`].

use crate::config::{Config, RawConfig};
use kvroute_core::plugin_config::{Config as PluginConfig, Mode, Role};
use std::collections::{BTreeMap, BTreeSet};

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// Something that will not work.
    Error(String),
    /// Worth knowing; not a failure.
    Note(String),
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Error(s) => write!(f, "error: {s}"),
            Self::Note(s) => write!(f, "note: {s}"),
        }
    }
}

/// What `--check` found: the lines to print, and what the Envoy config was checked
/// against and matched.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Errors and notes, in report order.
    pub findings: Vec<Finding>,
    /// What was checked against the Envoy config and matched, in this order when present:
    /// `clusters` (cluster mode, every endpoint's cluster defined), `ingest token` (every
    /// ingest filter accepts the token, or wants none), `ingest port` (every target posts
    /// to an ingest listener's port), `ingest path` (every target's URL path is the
    /// `ingest_path` of an ingest filter on its port). Empty
    /// without an Envoy config.
    pub envoy_matched: Vec<&'static str>,
}

impl Report {
    /// Number of [`Finding::Error`]s.
    pub fn errors(&self) -> usize {
        self.findings
            .iter()
            .filter(|f| matches!(f, Finding::Error(_)))
            .count()
    }
}

/// Envoy's `per_connection_buffer_limit_bytes` when a listener does not set it: 1 MiB
/// (envoy/config/listener/v3/listener.proto: "If unspecified, an implementation defined
/// default is applied (1MiB)"). A filter that reads the whole body before the request goes
/// on holds it in that buffer, and Envoy answers 413 past it.
pub const ENVOY_DEFAULT_BUFFER_LIMIT: u64 = 1024 * 1024;

/// What the kvroute filter configurations inside an Envoy config say.
#[derive(Debug, Default)]
struct EnvoyView {
    clusters: BTreeSet<String>,
    /// Routing filters.
    route: Vec<FilterView>,
    /// Ingest filters.
    ingest: Vec<FilterView>,
    /// kvroute plugin configurations the filter refuses (Envoy then refuses the plugin),
    /// each with where it is.
    invalid: Vec<String>,
    /// Listeners with a kvroute plugin lacking `allow_on_headers_stop_iteration: true`.
    no_stop: Vec<String>,
    /// Whether the file has `static_resources` (an Envoy bootstrap with its listeners and
    /// clusters written out, the only kind the cross-check reads).
    bootstrap: bool,
}

/// One valid kvroute filter configuration of an Envoy config, and its listener.
#[derive(Debug)]
struct FilterView {
    /// Its listener's port, when written as `socket_address.port_value`.
    port: Option<u64>,
    /// Its listener, as a report names it: `listener `main` (port 10000)`.
    listener: String,
    /// The listener's `per_connection_buffer_limit_bytes` as written, bytes (`None`: unset,
    /// [`ENVOY_DEFAULT_BUFFER_LIMIT`]).
    buffer_limit: Option<u64>,
    /// The configuration, validated by the filter's own rules.
    config: PluginConfig,
}

fn envoy_view(yaml: &str) -> Result<EnvoyView, String> {
    let v: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(yaml).map_err(|e| format!("Envoy config is not YAML: {e}"))?;
    let mut view = EnvoyView::default();
    let sr = v.get("static_resources");
    view.bootstrap = sr.is_some();
    for c in sr
        .and_then(|s| s.get("clusters"))
        .and_then(|c| c.as_sequence())
        .into_iter()
        .flatten()
    {
        if let Some(n) = c.get("name").and_then(|n| n.as_str()) {
            view.clusters.insert(n.to_owned());
        }
    }
    for l in sr
        .and_then(|s| s.get("listeners"))
        .and_then(|c| c.as_sequence())
        .into_iter()
        .flatten()
    {
        let port = l
            .get("address")
            .and_then(|a| a.get("socket_address"))
            .and_then(|s| s.get("port_value"))
            .and_then(serde_yaml_ng::Value::as_u64);
        let name = l
            .get("name")
            .and_then(|n| n.as_str())
            .unwrap_or("(unnamed)");
        let listener = match port {
            Some(p) => format!("listener `{name}` (port {p})"),
            None => format!("listener `{name}`"),
        };
        let buffer_limit = l
            .get("per_connection_buffer_limit_bytes")
            .and_then(proto_uint);
        let mut configs = Vec::new();
        filter_configs(l, &mut configs);
        for found in configs {
            if !found.stops {
                view.no_stop.push(listener.clone());
            }
            let parsed = found
                .config
                .and_then(|bytes| PluginConfig::parse(&bytes).map_err(|e| e.to_string()));
            match parsed {
                Ok(config) => {
                    let f = FilterView {
                        port,
                        listener: listener.clone(),
                        buffer_limit,
                        config,
                    };
                    match f.config.role {
                        Role::Ingest => view.ingest.push(f),
                        Role::Route => view.route.push(f),
                    }
                }
                Err(e) => view.invalid.push(format!(
                    "{listener}: {e}; Envoy refuses to load the plugin with this configuration"
                )),
            }
        }
    }
    Ok(view)
}

/// A protobuf `uint32`/`uint64` field as Envoy reads it from YAML (proto3's JSON mapping): a
/// number, an integral float (`2097152.0`) or a decimal string (`"2097152"`).
fn proto_uint(v: &serde_yaml_ng::Value) -> Option<u64> {
    match v {
        serde_yaml_ng::Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 2f64.powi(64))
                .map(|f| f as u64)
        }),
        serde_yaml_ng::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// Whether a plugin configuration names a field only kvroute's filter has: `role`, `mode`
/// or `picker`. Such a configuration is kvroute's whatever its module is called.
fn names_kvroute(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text).is_ok_and(|j| {
        j.as_object().is_some_and(|o| {
            ["role", "mode", "picker"]
                .iter()
                .any(|f| o.contains_key(*f))
        })
    })
}

/// The bytes a Wasm plugin (`plugin`, a mapping with a `vm_config`) hands to its module as
/// its configuration. Envoy unwraps a `google.protobuf.StringValue` (the string) and a
/// `google.protobuf.BytesValue` (written base64 in YAML, handed over decoded); any other
/// type, `google.protobuf.Struct` included, reaches the module as that message's protobuf
/// encoding, which the filter refuses as not JSON (Envoy 1.40 then refuses the plugin):
/// `Err` says so. No `configuration`, or no `@type` (as this module's tests write it), is
/// read as a string.
fn plugin_bytes(plugin: &serde_yaml_ng::Value) -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    let Some(c) = plugin.get("configuration") else {
        return Ok(Vec::new());
    };
    let kind = c.get("@type").and_then(|t| t.as_str()).unwrap_or_default();
    let kind = kind.rsplit('/').next().unwrap_or_default();
    match (kind, c.get("value")) {
        ("google.protobuf.StringValue" | "google.protobuf.BytesValue" | "", None) => Ok(Vec::new()),
        ("google.protobuf.StringValue" | "", Some(serde_yaml_ng::Value::String(t))) => {
            Ok(t.clone().into_bytes())
        }
        ("google.protobuf.BytesValue", Some(serde_yaml_ng::Value::String(b))) => {
            base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .map_err(|e| {
                    format!("a `google.protobuf.BytesValue` configuration is not base64: {e}")
                })
        }
        ("google.protobuf.StringValue" | "google.protobuf.BytesValue" | "", Some(_)) => {
            Err("the configuration's `value` is not a string".into())
        }
        (other, _) => Err(format!(
            "the configuration is a `{other}`, which Envoy hands to a Wasm plugin as protobuf \
             bytes, not JSON, so the filter refuses it; write the JSON as a \
             `google.protobuf.StringValue`"
        )),
    }
}

/// The kvroute configuration a Wasm plugin (`plugin`, a mapping with a `vm_config`) runs,
/// if it runs kvroute: whatever it is configured with when its module's file name says
/// `kvroute` (`kvroute_filter.wasm`: a configuration the filter refuses is then reported,
/// not skipped); otherwise a JSON object naming `role`, `mode` or `picker`
/// ([`names_kvroute`]). Another module's configuration made of keys the filter also has
/// (`{"prefix":"/api"}`) is not kvroute's.
fn plugin_kvroute_config(plugin: &serde_yaml_ng::Value) -> Option<Found> {
    let ours = plugin
        .get("vm_config")
        .and_then(|vm| vm.get("code"))
        .is_some_and(names_kvroute_file);
    let stops = plugin
        .get("allow_on_headers_stop_iteration")
        .and_then(serde_yaml_ng::Value::as_bool)
        == Some(true);
    let config = match plugin_bytes(plugin) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes).into_owned();
            (ours || names_kvroute(&text)).then_some(Ok(bytes))?
        }
        Err(e) => {
            // Not JSON as the module sees it: kvroute's when its file says so, or when the
            // value written names a kvroute field.
            let named = plugin
                .get("configuration")
                .and_then(|c| c.get("value"))
                .and_then(|v| serde_json::to_string(v).ok())
                .is_some_and(|j| names_kvroute(&j));
            (ours || named).then_some(Err(e))?
        }
    };
    Some(Found { config, stops })
}

/// A kvroute plugin found in an Envoy config ([`plugin_kvroute_config`]).
#[derive(Debug)]
struct Found {
    /// The configuration bytes the module receives, or why Envoy hands it none it can read.
    config: Result<Vec<u8>, String>,
    /// Whether the plugin has `allow_on_headers_stop_iteration: true`; a `value` string
    /// found outside a plugin counts as having it (its plugin is not known).
    stops: bool,
}

/// Whether a file name (the last `/`-separated part of a string) below `v` says `kvroute`.
fn names_kvroute_file(v: &serde_yaml_ng::Value) -> bool {
    match v {
        serde_yaml_ng::Value::String(s) => s
            .rsplit('/')
            .next()
            .is_some_and(|file| file.contains("kvroute")),
        serde_yaml_ng::Value::Mapping(m) => m.values().any(names_kvroute_file),
        serde_yaml_ng::Value::Sequence(s) => s.iter().any(names_kvroute_file),
        serde_yaml_ng::Value::Tagged(t) => names_kvroute_file(&t.value),
        _ => false,
    }
}

/// kvroute filter configurations below `v` ([`Found`]): for each Wasm plugin (a mapping with a
/// `vm_config`), what [`plugin_kvroute_config`] finds; elsewhere, JSON strings under a
/// `value` key that name `role`, `mode` or `picker`. Every configuration the filter runs is
/// found, except one without those keys in a module whose file name does not say
/// `kvroute`.
fn filter_configs(v: &serde_yaml_ng::Value, out: &mut Vec<Found>) {
    match v {
        serde_yaml_ng::Value::Mapping(m) => {
            if v.get("vm_config").is_some() {
                out.extend(plugin_kvroute_config(v));
                return;
            }
            for (k, val) in m {
                if let (Some("value"), Some(s)) = (k.as_str(), val.as_str()) {
                    if names_kvroute(s) {
                        out.push(Found {
                            config: Ok(s.as_bytes().to_vec()),
                            stops: true,
                        });
                    }
                }
                filter_configs(val, out);
            }
        }
        serde_yaml_ng::Value::Sequence(s) => s.iter().for_each(|x| filter_configs(x, out)),
        serde_yaml_ng::Value::Tagged(t) => filter_configs(&t.value, out),
        _ => {}
    }
}

/// Whether an endpoint `address` (`host:port`) names its host by an IP literal written as
/// Envoy writes a host's address (`10.0.0.1:8000`, `[::1]:8000`: the canonical text form,
/// RFC 5952 for IPv6), the form Envoy's `override_host` compares with its cluster's hosts:
/// `[0:0:0:0:0:0:0:1]:8000` is the same IP but never matches.
fn written_as_envoy_ip(address: &str) -> bool {
    let host = match address.strip_prefix('[') {
        Some(rest) => rest.split_once(']').map(|(h, _)| h),
        None => address.rsplit_once(':').map(|(h, _)| h),
    };
    host.is_some_and(|h| {
        h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_string() == h)
    })
}

/// Check a validated config (`raw` is the same file as written, for what was defaulted)
/// and optionally an Envoy config's text. `token` and `scrape_token` are what
/// [`crate::config::TokenSettings::read`] returned for `config.push.token()` and
/// `config.scrape.token()`, `pool_tokens` for each pool of `config.scrape.pool_tokens`
/// (by pool name); only their lengths are reported.
pub fn check(
    raw: &RawConfig,
    config: &Config,
    token: Option<&str>,
    scrape_token: Option<&str>,
    pool_tokens: &BTreeMap<String, Option<String>>,
    envoy_yaml: Option<&str>,
) -> Report {
    let mut out = Vec::new();
    let mut matched = Vec::new();
    let source = config.push.token_source();
    match (token, config.targets.is_empty()) {
        (Some(t), _) => out.push(Finding::Note(format!(
            "ingest token: found in {source} ({} bytes)",
            t.len()
        ))),
        (None, true) => out.push(Finding::Note(format!(
            "ingest token: none found in {source}; no targets, so none is needed"
        ))),
        (None, false) => out.push(Finding::Note(format!(
            "ingest token: none found in {source}: pushes carry no Authorization, and an \
             ingest filter with an `ingest_token` answers them 401"
        ))),
    }
    let which = if config.scrape.pool_tokens.is_empty() {
        "every scrape"
    } else {
        "every scrape of a pool without its own token"
    };
    if let Some(source) = config.scrape.token().source() {
        out.push(Finding::Note(match scrape_token {
            Some(t) => format!(
                "scrape token: found in {source} ({} bytes); {which} carries it",
                t.len()
            ),
            None => format!(
                "scrape token: none found in {source}: scrapes carry no Authorization, and a \
                 model server started with an API key (llama-server `--api-key`) answers them 401"
            ),
        }));
    }
    for (pool, settings) in &config.scrape.pool_tokens {
        let source = settings.source().unwrap_or_default();
        out.push(Finding::Note(
            match pool_tokens.get(pool).and_then(Option::as_ref) {
                Some(t) => format!(
                "scrape token of pool `{pool}`: found in {source} ({} bytes); its scrapes carry it",
                t.len()
            ),
                None => format!(
                    "scrape token of pool `{pool}`: none found in {source}: its scrapes carry no \
                 Authorization, and a model server started with an API key answers them 401"
                ),
            },
        ));
    }
    let unshared: Vec<&str> = config
        .targets
        .iter()
        .filter(|t| t.stats_url.is_none())
        .map(|t| t.name.as_str())
        .collect();
    if config.targets.len() >= 2 && !unshared.is_empty() {
        out.push(Finding::Note(format!(
            "load sharing: {} of {} targets have no `stats_url` ({}); their in-flight load is \
             not shared with the other gateways, which may then herd onto one endpoint \
             between scrapes",
            unshared.len(),
            config.targets.len(),
            unshared.join(", ")
        )));
    }
    for pool in &raw.pools {
        let defaulted: Vec<&str> = pool
            .endpoints
            .iter()
            .filter(|e| e.cluster.is_none())
            .map(|e| e.name.as_str())
            .collect();
        if !defaulted.is_empty() {
            out.push(Finding::Note(format!(
                "pool `{}`: `cluster` not set for {} endpoint(s) ({}); it defaults to the pool \
                 name, so in cluster mode the filter routes them to Envoy cluster `{}`",
                pool.name,
                defaulted.len(),
                defaulted.join(", "),
                pool.name
            )));
        }
    }
    let Some(yaml) = envoy_yaml else {
        return Report {
            findings: out,
            envoy_matched: matched,
        };
    };
    let view = match envoy_view(yaml) {
        Ok(v) => v,
        Err(e) => {
            out.push(Finding::Error(e));
            return Report {
                findings: out,
                envoy_matched: matched,
            };
        }
    };
    if !view.bootstrap {
        out.push(Finding::Note(
            "the Envoy config has no `static_resources`: `--envoy-config` cross-checks an Envoy \
             bootstrap's listeners and clusters; Istio resources (EnvoyFilter, WasmPlugin) and \
             configuration Envoy gets over xDS are not checked"
                .into(),
        ));
    }
    for l in &view.no_stop {
        out.push(Finding::Error(format!(
            "the Envoy config's kvroute plugin on {l} lacks `allow_on_headers_stop_iteration: \
             true` (a Wasm `PluginConfig` field, Envoy >= 1.35): without it the filter cannot \
             hold a request at its headers to read the body, so ingest pushes hang until they \
             time out and requests are routed without their body"
        )));
    }
    for e in &view.invalid {
        out.push(Finding::Error(format!(
            "the Envoy config's kvroute filter on {e}"
        )));
    }
    if view.invalid.is_empty()
        && view.no_stop.is_empty()
        && !(view.route.is_empty() && view.ingest.is_empty())
    {
        // Each one validated by the filter's own rules, as Envoy would load it.
        matched.push("kvroute plugin configs");
    }
    let mode = |m: Mode| view.route.iter().any(|f| f.config.mode == m);
    if mode(Mode::Cluster) {
        let mut missing: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for e in &config.endpoints {
            if !view.clusters.contains(&e.cluster) {
                missing.entry(&e.cluster).or_default().push(&e.id);
            }
        }
        if missing.is_empty() {
            matched.push("clusters");
        }
        for (cluster, ids) in missing {
            out.push(Finding::Error(format!(
                "cluster `{cluster}` (endpoints {}) is not defined in the Envoy config \
                 (clusters: {}); cluster mode would route them to a cluster Envoy does not have",
                ids.join(", "),
                view.clusters.iter().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
    } else if mode(Mode::Endpoint) {
        out.push(Finding::Note(
            "the Envoy config's kvroute filter runs in endpoint mode: `cluster` is not used".into(),
        ));
    }
    if mode(Mode::Endpoint) {
        let named: Vec<String> = config
            .endpoints
            .iter()
            .filter(|e| !written_as_envoy_ip(&e.address))
            .map(|e| format!("{} (`{}`)", e.id, e.address))
            .collect();
        if !named.is_empty() {
            out.push(Finding::Error(format!(
                "endpoint mode names the chosen host by its address, and Envoy matches it \
                 against its cluster's host addresses as text, IPs written the way Envoy \
                 writes them (`10.0.0.7:8000`, `[::1]:8000`); {} never match (a host name, \
                 or an IP written otherwise), so their requests would go wherever the \
                 cluster's fallback policy sends them",
                named.join(", ")
            )));
        }
    }
    for f in &view.route {
        let max = f.config.max_body_bytes;
        if let Some(head) = f.buffer_below(max) {
            out.push(Finding::Note(format!(
                "{head} the kvroute filter's `max_body_bytes` ({max}): Envoy answers its own 413 \
                 to a body between the two instead of letting the filter route it by load; set \
                 the limit to at least twice `max_body_bytes` (docs/filter.md)"
            )));
        }
    }
    for f in &view.ingest {
        let max = f.config.ingest_max_bytes;
        if let Some(head) = f.buffer_below(max) {
            out.push(Finding::Error(format!(
                "{head} the ingest filter's `ingest_max_bytes` ({max}): Envoy answers its own 413 \
                 to a snapshot between the two, and routing goes on with stale stats; set the \
                 listener's limit to at least `ingest_max_bytes`"
            )));
        }
    }
    if view.ingest.is_empty() && !config.targets.is_empty() {
        out.push(Finding::Error(
            "the Envoy config has no kvroute ingest filter (`\"role\":\"ingest\"`): pushes \
             would not reach the filter"
                .into(),
        ));
    }
    let token_errors = out.len();
    for f in &view.ingest {
        let envoy_token = f.config.ingest_token.as_str();
        match token {
            Some(t) if envoy_token != t => out.push(Finding::Error(format!(
                "the ingest token from {source} differs from the Envoy config's `ingest_token` \
                 on {}: every push would be answered 401",
                f.listener
            ))),
            None => out.push(Finding::Error(format!(
                "the Envoy config's ingest filter on {} requires an `ingest_token`, but none \
                 was found in {source}: every push would be answered 401",
                f.listener
            ))),
            _ => {}
        }
    }
    if !view.ingest.is_empty() && view.invalid.is_empty() && out.len() == token_errors {
        matched.push("ingest token");
    }
    let ports: BTreeSet<u64> = view.ingest.iter().filter_map(|i| i.port).collect();
    if !ports.is_empty() {
        let mut all_match = !config.targets.is_empty();
        for t in &config.targets {
            let port = u64::from(target_port(&t.url));
            if !ports.contains(&port) {
                all_match = false;
                out.push(Finding::Note(format!(
                    "target `{}` posts to port {port}, not an ingest listener port of this Envoy \
                     config ({}); fine if it is another Envoy",
                    t.name,
                    ports
                        .iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        if all_match {
            matched.push("ingest port");
        }
    }
    if !view.ingest.is_empty() && !config.targets.is_empty() {
        let mut all_match = true;
        for t in &config.targets {
            let port = u64::from(target_port(&t.url));
            let path = match t.url.path() {
                "" => "/",
                p => p,
            };
            // The ingest filters on the target's port: the ones its pushes reach, if it
            // posts to this Envoy. On none of them, it may post to another Envoy, and its
            // path is compared with every ingest filter's, as a note (like the port).
            let on_port: Vec<&FilterView> = view
                .ingest
                .iter()
                .filter(|i| i.port == Some(port))
                .collect();
            let certain = !on_port.is_empty();
            let candidates = if certain {
                on_port
            } else {
                view.ingest.iter().collect()
            };
            // Claimed to match only when the target reaches that filter for sure.
            all_match &= certain;
            if candidates.iter().any(|i| i.config.ingest_path == path) {
                continue;
            }
            all_match = false;
            let paths = candidates
                .iter()
                .map(|i| format!("`{}`", i.config.ingest_path))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
                .join(", ");
            out.push(if certain {
                Finding::Error(format!(
                    "target `{}` posts to path `{path}`, but the ingest filter on listener port \
                     {port} serves `ingest_path` {paths}: every push would be answered 404",
                    t.name
                ))
            } else {
                Finding::Note(format!(
                    "target `{}` posts to path `{path}`, not an `ingest_path` of this Envoy \
                     config ({paths}); fine if it is another Envoy",
                    t.name
                ))
            });
        }
        if all_match {
            matched.push("ingest path");
        }
    }
    Report {
        findings: out,
        envoy_matched: matched,
    }
}

impl FilterView {
    /// When the listener's buffer limit in effect is below `bytes` (a limit of the filter's
    /// that needs the whole body held): the start of a report line, naming the listener
    /// and the limit, up to "below".
    fn buffer_below(&self, bytes: usize) -> Option<String> {
        let (limit, source) = match self.buffer_limit {
            Some(b) => (b, ""),
            None => (
                ENVOY_DEFAULT_BUFFER_LIMIT,
                " (Envoy's default: the listener does not set it)",
            ),
        };
        (limit < bytes as u64).then(|| {
            format!(
                "{}: `per_connection_buffer_limit_bytes` is {limit} bytes{source}, below",
                self.listener
            )
        })
    }
}

/// The port a push to `url` connects to: the one written, else the scheme's default (443
/// for `https://`, 80 otherwise), as the push client does.
fn target_port(url: &http::Uri) -> u16 {
    url.port_u16().unwrap_or(match url.scheme_str() {
        Some("https") => 443,
        _ => 80,
    })
}

/// The end of `--check`'s `config ok` line for an Envoy config that matched in `matched`
/// ([`Report::envoy_matched`]): only what was checked and matched is claimed.
pub fn envoy_ok_suffix(matched: &[&str]) -> String {
    if matched.is_empty() {
        "; nothing in the Envoy config to match (no cluster-mode filter, ingest port, ingest path or ingest token checked)".into()
    } else {
        format!("; matches the Envoy config ({})", matched.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an endpoint-mode Envoy config matches in full (no clusters to match).
    const ALL_MATCHED: [&str; 4] = [
        "kvroute plugin configs",
        "ingest token",
        "ingest port",
        "ingest path",
    ];

    /// `--check` with one target posting to `url` against [`envoy`] on port 10001 whose
    /// ingest filter has `ingest_path` (the default when `None`): findings after the
    /// ingest-token note, and what matched.
    fn path_check(url: &str, ingest_path: Option<&str>) -> (Vec<Finding>, Vec<&'static str>) {
        let (raw, config) = parsed(&format!("targets:\n  - name: gw\n    url: {url}\n"));
        let mut yaml = envoy(10001, r#"{"mode":"endpoint"}"#);
        if let Some(p) = ingest_path {
            yaml = yaml.replace(
                r#""role":"ingest","#,
                &format!(r#""role":"ingest","ingest_path":"{p}","#),
            );
        }
        let r = check(
            &raw,
            &config,
            Some("tok-0123456789abcdef"),
            None,
            &BTreeMap::new(),
            Some(&yaml),
        );
        (r.findings[2..].to_vec(), r.envoy_matched)
    }

    /// A target whose URL path is not the `ingest_path` of the ingest filter on its port
    /// gets 404 for every push: an error (it was reported as matching). On a port of no
    /// ingest filter (another Envoy, maybe), a note, as for the port.
    #[test]
    fn a_target_path_other_than_the_ingest_path_is_reported() {
        assert_eq!(
            path_check("http://127.0.0.1:10001/kvroute/v1/snapshot", None),
            (vec![], ALL_MATCHED.to_vec())
        );
        assert_eq!(
            path_check("http://127.0.0.1:10001/in", Some("/in")),
            (vec![], ALL_MATCHED.to_vec())
        );
        assert_eq!(
            path_check("http://127.0.0.1:10001/snapshot?x=1", None),
            (
                vec![Finding::Error(
                    "target `gw` posts to path `/snapshot`, but the ingest filter on listener \
                     port 10001 serves `ingest_path` `/kvroute/v1/snapshot`: every push would \
                     be answered 404"
                        .into()
                )],
                vec!["kvroute plugin configs", "ingest token", "ingest port"]
            )
        );
        assert_eq!(
            path_check("http://127.0.0.1:10001/kvroute/v1/snapshot", Some("/in")),
            (
                vec![Finding::Error(
                    "target `gw` posts to path `/kvroute/v1/snapshot`, but the ingest filter on \
                     listener port 10001 serves `ingest_path` `/in`: every push would be \
                     answered 404"
                        .into()
                )],
                vec!["kvroute plugin configs", "ingest token", "ingest port"]
            )
        );
        assert_eq!(
            path_check("http://127.0.0.1:10101/snapshot", None),
            (
                vec![
                    Finding::Note(
                        "target `gw` posts to port 10101, not an ingest listener port of this \
                         Envoy config (10001); fine if it is another Envoy"
                            .into()
                    ),
                    Finding::Note(
                        "target `gw` posts to path `/snapshot`, not an `ingest_path` of this \
                         Envoy config (`/kvroute/v1/snapshot`); fine if it is another Envoy"
                            .into()
                    )
                ],
                vec!["kvroute plugin configs", "ingest token"]
            )
        );
    }

    /// A config with one endpoint whose Envoy cluster is `missing`.
    const MISSING_CLUSTER: &str = "pools:\n  - name: p\n    endpoints:\n      - name: a\n        address: 127.0.0.1:8001\n        cluster: missing\n";

    /// What `--check` says about [`MISSING_CLUSTER`] and `envoy_yaml` (with the right
    /// ingest token): the findings after the ingest-token note, and what matched.
    fn cluster_check(envoy_yaml: &str) -> (Vec<Finding>, Vec<&'static str>) {
        envoy_check(MISSING_CLUSTER, envoy_yaml)
    }

    /// What `--check` says about the config `yaml` and `envoy_yaml`, with the right ingest
    /// token: the findings after the ingest-token note, and what matched.
    fn envoy_check(yaml: &str, envoy_yaml: &str) -> (Vec<Finding>, Vec<&'static str>) {
        let (raw, config) = parsed(yaml);
        let r = check(
            &raw,
            &config,
            Some("tok-0123456789abcdef"),
            None,
            &BTreeMap::new(),
            Some(envoy_yaml),
        );
        (r.findings[1..].to_vec(), r.envoy_matched)
    }

    const MISSING_ERROR: &str = "cluster `missing` (endpoints p/a) is not defined in the Envoy \
         config (clusters: c); cluster mode would route them to a cluster Envoy does not have";

    /// A route filter without `mode` runs in cluster mode (the filter's default), so the
    /// clusters are checked; so are configs without `role`, `mode` or `picker`, and an
    /// empty configuration of the kvroute module. Before, all three were taken for endpoint
    /// mode or not recognised, and a missing cluster passed.
    #[test]
    fn a_route_filter_without_mode_is_checked_in_cluster_mode() {
        for route in [
            r#"{"picker":{"policy":"hybrid"}}"#,
            r#"{"decision_record":true}"#,
            "{}",
            "",
        ] {
            assert_eq!(
                cluster_check(&envoy(10001, route)),
                (
                    vec![Finding::Error(MISSING_ERROR.into())],
                    vec!["kvroute plugin configs", "ingest token"]
                ),
                "route config {route:?}"
            );
        }
        // No `configuration` at all.
        let bare = envoy(10001, "").replace("            configuration: {value: ''}\n", "");
        assert!(!bare.contains("value: ''"), "{bare}");
        assert_eq!(
            cluster_check(&bare),
            (
                vec![Finding::Error(MISSING_ERROR.into())],
                vec!["kvroute plugin configs", "ingest token"]
            ),
        );
        // Endpoint mode, written: the cluster is not used.
        assert_eq!(
            cluster_check(&envoy(10001, r#"{"mode":"endpoint"}"#)),
            (
                vec![Finding::Note(
                    "the Envoy config's kvroute filter runs in endpoint mode: `cluster` is not \
                     used"
                        .into()
                )],
                vec!["kvroute plugin configs", "ingest token"]
            )
        );
        // Another Wasm module's empty or foreign configuration is not kvroute's, nor is
        // one of keys the filter also has (`prefix`), nor a module in a folder named
        // after kvroute.
        for (file, config) in [
            ("other.wasm", "{}"),
            ("other.wasm", r#"{"rules":[]}"#),
            ("header_rewrite.wasm", r#"{"prefix":"/api"}"#),
            ("kvroute/other.wasm", r#"{"rules":[]}"#),
        ] {
            let other = envoy(10001, config).replacen("kvroute_filter.wasm", file, 1);
            assert_eq!(
                cluster_check(&other),
                (vec![], vec!["kvroute plugin configs", "ingest token"]),
                "{file} {config}"
            );
        }
    }

    /// What `--check` says about one endpoint at `address` (cluster `c`) against
    /// `envoy_yaml`, with the right ingest token: the findings after the token note.
    fn endpoint_check(address: &str, envoy_yaml: &str) -> (Vec<Finding>, Vec<&'static str>) {
        envoy_check(
            &format!(
                "pools:\n  - name: p\n    endpoints:\n      - name: a\n        address: '{address}'\n        cluster: c\n"
            ),
            envoy_yaml,
        )
    }

    /// A kvroute plugin configuration the filter refuses (and Envoy with it) is an error
    /// naming the listener and the filter's own message, and nothing is claimed to match
    /// the ingest token; such configurations passed as `config ok`.
    #[test]
    fn plugin_configs_the_filter_refuses_are_errors() {
        let ingest = r#"{"role":"ingest","ingest_token":"tok-0123456789abcdef"}"#;
        let cases = [
            (
                r#"{"mode":"cluster",,}"#,
                "listener `main` (port 10000): kvroute plugin config is not valid JSON: key \
                 must be a string at line 1 column 19",
            ),
            (
                r#"{"role":"ingest","ingest_token":"short"}"#,
                "listener `ingest` (port 10001): kvroute plugin config field `ingest_token` = \
                 <redacted>: role ingest needs a token of at least 16 characters",
            ),
            (
                r#"{"role":"ingest"}"#,
                "listener `ingest` (port 10001): kvroute plugin config field `ingest_token` = \
                 <redacted>: role ingest needs a token of at least 16 characters",
            ),
            (
                r#"{"role":"ingest","ingest_token":5}"#,
                "listener `ingest` (port 10001): kvroute plugin config: invalid type: integer \
                 `5`, expected a string at line 1 column 33 (fields and values: docs/filter.md, \
                 \"Configuration reference\")",
            ),
        ];
        for (bad, message) in cases {
            let yaml = if bad.contains("ingest") {
                envoy(10001, "{}").replace(ingest, bad)
            } else {
                envoy(10001, bad)
            };
            let (findings, matched) = endpoint_check("127.0.0.1:8001", &yaml);
            assert_eq!(
                findings.first(),
                Some(&Finding::Error(format!(
                    "the Envoy config's kvroute filter on {message}; Envoy refuses to load the \
                     plugin with this configuration"
                ))),
                "{bad}"
            );
            assert!(!matched.contains(&"ingest token"), "{bad}: {matched:?}");
            assert!(
                !matched.contains(&"kvroute plugin configs"),
                "{bad}: {matched:?}"
            );
        }
        assert_eq!(
            endpoint_check("127.0.0.1:8001", &envoy(10001, "{}")),
            (
                vec![],
                vec!["kvroute plugin configs", "clusters", "ingest token"]
            )
        );
    }

    /// A listener whose buffer limit is below what its kvroute filter reads is reported:
    /// an error for the ingest filter (pushes of larger snapshots get Envoy's 413), a note
    /// for the route filter (larger bodies get Envoy's 413 instead of being routed by load).
    #[test]
    fn a_buffer_limit_below_the_filter_limits_is_reported() {
        let ingest = r#"{"role":"ingest","ingest_token":"tok-0123456789abcdef"}"#;
        let bigger =
            r#"{"role":"ingest","ingest_token":"tok-0123456789abcdef","ingest_max_bytes":4194304}"#;
        let yaml = envoy(10001, "{}").replace(ingest, bigger);
        assert_eq!(
            endpoint_check("127.0.0.1:8001", &yaml).0,
            vec![Finding::Error(
                "listener `ingest` (port 10001): `per_connection_buffer_limit_bytes` is 1048576 \
                 bytes (Envoy's default: the listener does not set it), below the ingest \
                 filter's `ingest_max_bytes` (4194304): Envoy answers its own 413 to a snapshot \
                 between the two, and routing goes on with stale stats; set the listener's \
                 limit to at least `ingest_max_bytes`"
                    .into()
            )]
        );
        let raised = yaml.replace(
            "  - name: ingest\n",
            "  - name: ingest\n    per_connection_buffer_limit_bytes: 4194304\n",
        );
        assert_eq!(endpoint_check("127.0.0.1:8001", &raised).0, vec![]);
        let route_default = envoy(10001, r#"{"max_body_bytes":2097152}"#)
            .replace("    per_connection_buffer_limit_bytes: 8388608\n", "");
        assert_eq!(
            endpoint_check("127.0.0.1:8001", &route_default).0,
            vec![Finding::Note(
                "listener `main` (port 10000): `per_connection_buffer_limit_bytes` is 1048576 \
                 bytes (Envoy's default: the listener does not set it), below the kvroute \
                 filter's `max_body_bytes` (2097152): Envoy answers its own 413 to a body \
                 between the two instead of letting the filter route it by load; set the limit \
                 to at least twice `max_body_bytes` (docs/filter.md)"
                    .into()
            )]
        );
    }

    /// A file without `static_resources` (an Istio EnvoyFilter) is said not to be
    /// cross-checked, instead of passing with nothing matched and no word why.
    #[test]
    fn a_file_without_static_resources_is_said_not_to_be_checked() {
        let istio = "apiVersion: networking.istio.io/v1alpha3\nkind: EnvoyFilter\nmetadata: {name: kvroute}\n";
        assert_eq!(
            endpoint_check("127.0.0.1:8001", istio),
            (
                vec![Finding::Note(
                    "the Envoy config has no `static_resources`: `--envoy-config` cross-checks \
                     an Envoy bootstrap's listeners and clusters; Istio resources (EnvoyFilter, \
                     WasmPlugin) and configuration Envoy gets over xDS are not checked"
                        .into()
                )],
                vec![]
            )
        );
    }

    /// In endpoint mode an endpoint named by a host name is an error: Envoy matches the
    /// endpoint header against its cluster's host IPs, and a miss goes to the fallback
    /// policy's host, silently (the decision record named the unmatched endpoint).
    #[test]
    fn endpoint_mode_needs_ip_addresses() {
        let yaml = envoy(10001, r#"{"mode":"endpoint"}"#);
        let note = Finding::Note(
            "the Envoy config's kvroute filter runs in endpoint mode: `cluster` is not used".into(),
        );
        for ok in ["10.0.0.1:8000", "[::1]:8000", "[fd00::7]:8000"] {
            assert_eq!(endpoint_check(ok, &yaml).0, vec![note.clone()], "{ok}");
        }
        // The same IPs written otherwise: Envoy's text never equals them.
        for odd in [
            "[0:0:0:0:0:0:0:1]:8000",
            "[::FFFF:127.0.0.1]:8000",
            "[FD00::7]:8000",
        ] {
            assert_eq!(endpoint_check(odd, &yaml).0.len(), 2, "{odd}");
        }
        assert_eq!(
            endpoint_check("vllm-1.example:8002", &yaml).0,
            vec![
                note,
                Finding::Error(
                    "endpoint mode names the chosen host by its address, and Envoy matches it \
                     against its cluster's host addresses as text, IPs written the way Envoy \
                     writes them (`10.0.0.7:8000`, `[::1]:8000`); p/a (`vllm-1.example:8002`) \
                     never match (a host name, or an IP written otherwise), so their requests \
                     would go wherever the cluster's fallback policy sends them"
                        .into()
                )
            ]
        );
        // Cluster mode does not care.
        assert_eq!(
            endpoint_check("vllm-1.example:8002", &envoy(10001, "{}")).0,
            vec![]
        );
    }

    /// A `google.protobuf.Struct` configuration reaches a Wasm plugin as protobuf bytes,
    /// which the filter refuses (Envoy 1.40 then refuses the plugin): an error, where it
    /// passed as JSON. A `google.protobuf.BytesValue` is handed over decoded, so its base64
    /// text is the configuration (it was parsed as written and refused).
    #[test]
    fn configurations_are_read_as_envoy_hands_them_over() {
        let ingest =
            r#"configuration: {value: '{"role":"ingest","ingest_token":"tok-0123456789abcdef"}'}"#;
        let structured = envoy(10001, "").replace(
            ingest,
            "configuration: {'@type': type.googleapis.com/google.protobuf.Struct, value: {role: ingest, ingest_token: tok-0123456789abcdef}}",
        );
        let (findings, matched) = endpoint_check("127.0.0.1:8001", &structured);
        assert_eq!(
            findings.first(),
            Some(&Finding::Error(
                "the Envoy config's kvroute filter on listener `ingest` (port 10001): the \
                 configuration is a `google.protobuf.Struct`, which Envoy hands to a Wasm plugin \
                 as protobuf bytes, not JSON, so the filter refuses it; write the JSON as a \
                 `google.protobuf.StringValue`; Envoy refuses to load the plugin with this \
                 configuration"
                    .into()
            ))
        );
        assert!(!matched.contains(&"ingest token"), "{matched:?}");
        // base64 of {"role":"ingest","ingest_token":"tok-0123456789abcdef"}
        let bytes = envoy(10001, "").replace(
            ingest,
            "configuration: {'@type': type.googleapis.com/google.protobuf.BytesValue, value: eyJyb2xlIjoiaW5nZXN0IiwiaW5nZXN0X3Rva2VuIjoidG9rLTAxMjM0NTY3ODlhYmNkZWYifQ==}",
        );
        assert_eq!(
            endpoint_check("127.0.0.1:8001", &bytes),
            (
                vec![],
                vec!["kvroute plugin configs", "clusters", "ingest token"]
            )
        );
    }

    /// A kvroute plugin without `allow_on_headers_stop_iteration: true` cannot read bodies
    /// (ingest pushes hang): an error naming its listener.
    #[test]
    fn a_plugin_that_cannot_stop_at_headers_is_an_error() {
        let yaml = envoy(10001, "{}").replacen(
            "            allow_on_headers_stop_iteration: true\n",
            "",
            1,
        );
        assert_eq!(
            endpoint_check("127.0.0.1:8001", &yaml).0,
            vec![Finding::Error(
                "the Envoy config's kvroute plugin on listener `main` (port 10000) lacks \
                 `allow_on_headers_stop_iteration: true` (a Wasm `PluginConfig` field, Envoy >= \
                 1.35): without it the filter cannot hold a request at its headers to read the \
                 body, so ingest pushes hang until they time out and requests are routed \
                 without their body"
                    .into()
            )]
        );
    }

    /// `per_connection_buffer_limit_bytes` written as Envoy also reads it: a decimal string
    /// or an integral float (they read as unset, Envoy's 1 MiB).
    #[test]
    fn buffer_limits_are_read_in_every_form_envoy_takes() {
        let bigger =
            r#"{"role":"ingest","ingest_token":"tok-0123456789abcdef","ingest_max_bytes":4194304}"#;
        let base = envoy(10001, "{}").replace(
            r#"{"role":"ingest","ingest_token":"tok-0123456789abcdef"}"#,
            bigger,
        );
        for (limit, errors) in [("'8388608'", 0), ("8388608.0", 0), ("'100'", 1), ("100", 1)] {
            let yaml = base.replace(
                "  - name: ingest\n",
                &format!("  - name: ingest\n    per_connection_buffer_limit_bytes: {limit}\n"),
            );
            let found = endpoint_check("127.0.0.1:8001", &yaml).0;
            assert_eq!(found.len(), errors, "{limit}: {found:?}");
        }
    }

    /// `config` and its file as written, from YAML.
    fn parsed(yaml: &str) -> (RawConfig, Config) {
        Config::from_yaml_raw(yaml).unwrap()
    }

    /// An ingest listener on `port` (inline token `tok-0123456789abcdef`) and a route
    /// filter configured with `route_json`, plus cluster `c`.
    fn envoy(port: u16, route_json: &str) -> String {
        format!(
            "static_resources:\n  listeners:\n  - name: main\n    address: {{socket_address: {{address: 0.0.0.0, port_value: 10000}}}}\n    per_connection_buffer_limit_bytes: 8388608\n    filter_chains:\n    - filters:\n      - name: wasm\n        typed_config:\n          config:\n            allow_on_headers_stop_iteration: true\n            vm_config: {{vm_id: kvroute, code: {{local: {{filename: /etc/envoy/kvroute_filter.wasm}}}}}}\n            configuration: {{value: '{route_json}'}}\n  - name: ingest\n    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}\n    filter_chains:\n    - filters:\n      - name: wasm\n        typed_config:\n          config:\n            allow_on_headers_stop_iteration: true\n            vm_config: {{vm_id: kvroute, code: {{local: {{filename: /etc/envoy/kvroute_filter.wasm}}}}}}\n            configuration: {{value: '{{\"role\":\"ingest\",\"ingest_token\":\"tok-0123456789abcdef\"}}'}}\n  clusters:\n  - name: c\n"
        )
    }

    /// An `https://` target without a port posts to 443, not 80: it matches an ingest
    /// listener on 443 (it was reported as posting to port 80).
    #[test]
    fn an_https_target_without_a_port_posts_to_443() {
        // Target `url` against an endpoint-mode Envoy config whose ingest listener is on 443.
        let on_443 = |url: &str| {
            let (raw, config) = parsed(&format!("targets:\n  - name: gw\n    url: {url}\n"));
            check(
                &raw,
                &config,
                Some("tok-0123456789abcdef"),
                None,
                &BTreeMap::new(),
                Some(&envoy(443, r#"{"mode":"endpoint"}"#)),
            )
        };
        let r = on_443("https://envoy.example/kvroute/v1/snapshot");
        assert_eq!(r.errors(), 0, "{:?}", r.findings);
        assert_eq!(r.envoy_matched, ALL_MATCHED.to_vec());
        let r = on_443("http://envoy.example/kvroute/v1/snapshot");
        assert_eq!(
            r.findings.last(),
            Some(&Finding::Note(
                "target `gw` posts to port 80, not an ingest listener port of this Envoy config \
                 (443); fine if it is another Envoy"
                    .into()
            ))
        );
    }

    /// The `config ok` line claims only what matched.
    #[test]
    fn envoy_ok_suffix_names_only_what_matched() {
        assert_eq!(
            envoy_ok_suffix(&["kvroute plugin configs", "clusters", "ingest token"]),
            "; matches the Envoy config (kvroute plugin configs, clusters, ingest token)"
        );
        assert_eq!(
            envoy_ok_suffix(&[]),
            "; nothing in the Envoy config to match (no cluster-mode filter, ingest port, ingest path or ingest token checked)"
        );
    }
}
