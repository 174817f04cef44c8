//! `kvroute-cp --check`: validate a config without starting, and say what it will do.
//!
//! Beyond parsing and validating ([`crate::config`]), the check reports what is otherwise
//! only visible at run time:
//! - whether an ingest token was found, and where from (never the token itself);
//! - with `scrape.token_file` or `scrape.token_env` set, the same for the scrape token;
//! - which endpoints' Envoy `cluster` defaults to their pool's name (cluster mode routes to
//!   that cluster, so a missing Envoy cluster of that name is a 503 at request time);
//! - with an Envoy config (`--envoy-config`), a cross-check: every endpoint's cluster is
//!   defined when a kvroute filter runs in cluster mode; the ingest filter's
//!   `ingest_token`, when written inline, equals the token found; each target's port (the
//!   scheme's default when none is written: 80, or 443 for `https://`) is a listener port
//!   carrying the ingest filter, and its URL path that filter's `ingest_path` (else every
//!   push is answered 404).
//!
//! A kvroute filter is found in the Envoy config by its configuration, as the filter reads
//! it (a JSON string or a `google.protobuf.Struct`): an object with `role`, `mode` or
//! `picker`, in any module; or, in a Wasm module whose file name or URL says `kvroute`, one
//! with the filter's keys only (`{"decision_record":true}`) or an empty one. Without
//! `role` it routes; without `mode`, in cluster mode
//! (the filter's defaults).
//!
//! Findings are [`Finding::Error`] (the check fails, exit 2) or [`Finding::Note`].

use crate::config::{Config, RawConfig};
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

/// What the kvroute filter configurations inside an Envoy config say.
#[derive(Debug, Default)]
struct EnvoyView {
    clusters: BTreeSet<String>,
    /// Routing filter modes found (`cluster`, `endpoint`).
    modes: BTreeSet<String>,
    /// Ingest filters.
    ingest: Vec<IngestView>,
}

/// One ingest filter of an Envoy config.
#[derive(Debug)]
struct IngestView {
    /// Its listener's port, when written as `socket_address.port_value`.
    port: Option<u64>,
    /// Its `ingest_token`, when written inline.
    token: Option<String>,
    /// Its `ingest_path` (default [`kvroute_core::snapshot::INGEST_PATH`]).
    path: String,
}

fn envoy_view(yaml: &str) -> Result<EnvoyView, String> {
    let v: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(yaml).map_err(|e| format!("Envoy config is not YAML: {e}"))?;
    let mut view = EnvoyView::default();
    let sr = v.get("static_resources");
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
        let mut configs = Vec::new();
        filter_configs(l, &mut configs);
        for c in configs {
            if c.get("role").and_then(|r| r.as_str()) == Some("ingest") {
                let token = c
                    .get("ingest_token")
                    .and_then(|t| t.as_str())
                    .map(str::to_owned);
                let path = c
                    .get("ingest_path")
                    .and_then(|p| p.as_str())
                    .unwrap_or(kvroute_core::snapshot::INGEST_PATH)
                    .to_owned();
                view.ingest.push(IngestView { port, token, path });
            } else {
                // The filter's default mode is `cluster` (filter/src/config.rs `Mode`).
                let mode = c.get("mode").and_then(|m| m.as_str()).unwrap_or("cluster");
                view.modes.insert(mode.to_owned());
            }
        }
    }
    Ok(view)
}

/// The top-level keys of the filter's plugin configuration: filter/src/config.rs
/// `RawConfig`, with kvroute-core's `RouterConfig` keys flattened in. docs/filter.md's
/// "Configuration reference" lists the same (`tests::filter_keys_match_the_filter_docs`).
const FILTER_KEYS: &[&str] = &[
    "role",
    "mode",
    "cluster_header",
    "endpoint_header",
    "max_body_bytes",
    "ingest_path",
    "ingest_token",
    "ingest_max_bytes",
    "queue_name",
    "vm_id",
    "reservation_ttl_ms",
    "inflight_share_ms",
    "picker",
    "estimator",
    "prefix",
    "prefix_index_blocks",
    "models",
    "calibrate",
    "usage_sample_ms",
    "admission",
    "fail_open",
    "debug_header",
    "usage_tail_bytes",
    "decision_record",
    "share_affinity",
    "share_learning",
    "affinity_sync_ms",
    "affinity_journal_bytes",
];

/// Whether a plugin configuration names a field only kvroute's filter has: `role`, `mode`
/// or `picker`. Such a configuration is kvroute's whatever its module is called.
fn names_kvroute(o: &serde_json::Map<String, serde_json::Value>) -> bool {
    ["role", "mode", "picker"]
        .iter()
        .any(|f| o.contains_key(*f))
}

/// What a Wasm plugin (`plugin`, a mapping with a `vm_config`) runs as its configuration,
/// as JSON: the `configuration.value` string parsed (none, or a blank one, is `{}`), or a
/// `google.protobuf.Struct` value (a mapping), which Envoy hands to the plugin as JSON.
/// `None` when it is not JSON.
fn plugin_json(plugin: &serde_yaml_ng::Value) -> Option<serde_json::Value> {
    match plugin.get("configuration").and_then(|c| c.get("value")) {
        None => Some(serde_json::Value::Object(serde_json::Map::new())),
        Some(serde_yaml_ng::Value::String(t)) if t.trim().is_empty() => {
            Some(serde_json::Value::Object(serde_json::Map::new()))
        }
        Some(serde_yaml_ng::Value::String(t)) => serde_json::from_str(t).ok(),
        Some(v) => serde_json::to_value(v).ok(),
    }
}

/// The kvroute configuration a Wasm plugin (`plugin`, a mapping with a `vm_config`) runs,
/// if it runs kvroute: a JSON object naming `role`, `mode` or `picker` ([`names_kvroute`]),
/// or, for a module whose code's file name or URL says `kvroute` (`kvroute_filter.wasm`),
/// an object of the filter's keys only, the empty one included (the filter then runs with
/// its defaults: role `route`, mode `cluster`). Another module's configuration made of
/// keys the filter also has (`{"prefix":"/api"}`) is not kvroute's.
fn plugin_kvroute_config(plugin: &serde_yaml_ng::Value) -> Option<serde_json::Value> {
    let ours = plugin
        .get("vm_config")
        .and_then(|vm| vm.get("code"))
        .is_some_and(mentions_kvroute);
    let j = plugin_json(plugin)?;
    let o = j.as_object()?;
    let only_filter_keys = o.keys().all(|k| FILTER_KEYS.contains(&k.as_str()));
    (names_kvroute(o) || (ours && only_filter_keys)).then_some(j)
}

/// Whether a string below `v` contains `kvroute`.
fn mentions_kvroute(v: &serde_yaml_ng::Value) -> bool {
    match v {
        serde_yaml_ng::Value::String(s) => s.contains("kvroute"),
        serde_yaml_ng::Value::Mapping(m) => m.values().any(mentions_kvroute),
        serde_yaml_ng::Value::Sequence(s) => s.iter().any(mentions_kvroute),
        serde_yaml_ng::Value::Tagged(t) => mentions_kvroute(&t.value),
        _ => false,
    }
}

/// kvroute filter configurations below `v`: for each Wasm plugin (a mapping with a
/// `vm_config`), what [`plugin_kvroute_config`] finds; elsewhere, JSON strings under a
/// `value` key that name `role`, `mode` or `picker`. Every configuration the filter runs is
/// found, except one of only the filter's optional keys, or none, in a module whose file
/// name or URL does not say `kvroute`.
fn filter_configs(v: &serde_yaml_ng::Value, out: &mut Vec<serde_json::Value>) {
    match v {
        serde_yaml_ng::Value::Mapping(m) => {
            if v.get("vm_config").is_some() {
                out.extend(plugin_kvroute_config(v));
                return;
            }
            for (k, val) in m {
                if let (Some("value"), Some(s)) = (k.as_str(), val.as_str()) {
                    let j = serde_json::from_str::<serde_json::Value>(s).ok();
                    if let Some(j) = j.filter(|j| j.as_object().is_some_and(names_kvroute)) {
                        out.push(j);
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

/// Check a validated config (`raw` is the same file as written, for what was defaulted)
/// and optionally an Envoy config's text. `token` and `scrape_token` are what
/// [`crate::config::TokenSettings::read`] returned for `config.push.token()` and
/// `config.scrape.token()`; only their lengths are reported.
pub fn check(
    raw: &RawConfig,
    config: &Config,
    token: Option<&str>,
    scrape_token: Option<&str>,
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
    if let Some(source) = config.scrape.token().source() {
        out.push(Finding::Note(match scrape_token {
            Some(t) => format!(
                "scrape token: found in {source} ({} bytes); every scrape carries it",
                t.len()
            ),
            None => format!(
                "scrape token: none found in {source}: scrapes carry no Authorization, and a \
                 model server started with an API key (llama-server `--api-key`) answers them 401"
            ),
        }));
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
    if view.modes.contains("cluster") {
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
    } else if !view.modes.is_empty() {
        out.push(Finding::Note(
            "the Envoy config's kvroute filter runs in endpoint mode: `cluster` is not used".into(),
        ));
    }
    if view.ingest.is_empty() && !config.targets.is_empty() {
        out.push(Finding::Error(
            "the Envoy config has no kvroute ingest filter (`\"role\":\"ingest\"`): pushes \
             would not reach the filter"
                .into(),
        ));
    }
    let token_errors = out.len();
    for IngestView {
        port,
        token: envoy_token,
        ..
    } in &view.ingest
    {
        match (envoy_token.as_deref(), token) {
            (Some(e), Some(t)) if e != t => out.push(Finding::Error(format!(
                "the ingest token from {source} differs from the Envoy config's `ingest_token`{}: \
                 every push would be answered 401",
                port.map(|p| format!(" (listener port {p})"))
                    .unwrap_or_default()
            ))),
            (Some(_), None) => out.push(Finding::Error(format!(
                "the Envoy config's ingest filter requires an `ingest_token`, but none was found \
                 in {source}: every push would be answered 401"
            ))),
            _ => {}
        }
    }
    if !view.ingest.is_empty() && out.len() == token_errors {
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
            let on_port: Vec<&IngestView> = view
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
            if candidates.iter().any(|i| i.path == path) {
                continue;
            }
            all_match = false;
            let paths = candidates
                .iter()
                .map(|i| format!("`{}`", i.path))
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
            (vec![], vec!["ingest token", "ingest port", "ingest path"])
        );
        assert_eq!(
            path_check("http://127.0.0.1:10001/in", Some("/in")),
            (vec![], vec!["ingest token", "ingest port", "ingest path"])
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
                vec!["ingest token", "ingest port"]
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
                vec!["ingest token", "ingest port"]
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
                vec!["ingest token"]
            )
        );
    }

    /// A config with one endpoint whose Envoy cluster is `missing`.
    const MISSING_CLUSTER: &str = "pools:\n  - name: p\n    endpoints:\n      - name: a\n        address: 127.0.0.1:8001\n        cluster: missing\n";

    /// What `--check` says about [`MISSING_CLUSTER`] and `envoy_yaml` (with the right
    /// ingest token): the findings after the ingest-token note, and what matched.
    fn cluster_check(envoy_yaml: &str) -> (Vec<Finding>, Vec<&'static str>) {
        let (raw, config) = parsed(MISSING_CLUSTER);
        let r = check(
            &raw,
            &config,
            Some("tok-0123456789abcdef"),
            None,
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
                    vec!["ingest token"]
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
                vec!["ingest token"]
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
                vec!["ingest token"]
            )
        );
        // Another Wasm module's empty or foreign configuration is not kvroute's.
        let other = envoy(10001, "{}").replacen("kvroute_filter.wasm", "other.wasm", 1);
        assert_eq!(cluster_check(&other), (vec![], vec!["ingest token"]));
        let other = envoy(10001, r#"{"rules":[]}"#);
        assert_eq!(cluster_check(&other), (vec![], vec!["ingest token"]));
        // Another module configured with keys the filter also has (`prefix`): not
        // kvroute's, though a kvroute module with the same configuration would be.
        let other = envoy(10001, r#"{"prefix":"/api"}"#).replacen(
            "kvroute_filter.wasm",
            "header_rewrite.wasm",
            1,
        );
        assert_eq!(cluster_check(&other), (vec![], vec!["ingest token"]));
    }

    /// Plugins configured with a `google.protobuf.Struct` (a mapping, which Envoy hands to
    /// the plugin as JSON) are found, the ingest filter's token and the route filter's mode
    /// included; they were not (no ingest filter, exit 2).
    #[test]
    fn struct_configured_plugins_are_found() {
        let yaml = envoy(10001, "").replace(
            "configuration: {value: ''}",
            "configuration: {'@type': type.googleapis.com/google.protobuf.Struct, value: {mode: endpoint}}",
        ).replace(
            r#"configuration: {value: '{"role":"ingest","ingest_token":"tok-0123456789abcdef"}'}"#,
            "configuration: {'@type': type.googleapis.com/google.protobuf.Struct, value: {role: ingest, ingest_token: tok-0123456789abcdef}}",
        );
        assert!(!yaml.contains("value: '"), "{yaml}");
        assert_eq!(
            cluster_check(&yaml),
            (
                vec![Finding::Note(
                    "the Envoy config's kvroute filter runs in endpoint mode: `cluster` is not \
                     used"
                        .into()
                )],
                vec!["ingest token"]
            )
        );
    }

    /// [`FILTER_KEYS`] are the top-level keys of docs/filter.md's configuration table.
    #[test]
    fn filter_keys_match_the_filter_docs() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/filter.md"))
                .unwrap();
        let table = doc.split("## Configuration reference").nth(1).unwrap();
        let documented: BTreeSet<&str> = table
            .lines()
            .skip_while(|l| !l.starts_with("| field |"))
            .skip(2)
            .take_while(|l| l.starts_with("| `"))
            .map(|l| {
                let field = l[3..].split('`').next().unwrap();
                field.split('.').next().unwrap()
            })
            .collect();
        let ours: BTreeSet<&str> = FILTER_KEYS.iter().copied().collect();
        assert_eq!(documented, ours);
    }

    /// `config` and its file as written, from YAML.
    fn parsed(yaml: &str) -> (RawConfig, Config) {
        Config::from_yaml_raw(yaml).unwrap()
    }

    /// An ingest listener on `port` (inline token `tok-0123456789abcdef`) and a route
    /// filter configured with `route_json`, plus cluster `c`.
    fn envoy(port: u16, route_json: &str) -> String {
        format!(
            "static_resources:\n  listeners:\n  - name: main\n    address: {{socket_address: {{address: 0.0.0.0, port_value: 10000}}}}\n    filter_chains:\n    - filters:\n      - name: wasm\n        typed_config:\n          config:\n            vm_config: {{vm_id: kvroute, code: {{local: {{filename: /etc/envoy/kvroute_filter.wasm}}}}}}\n            configuration: {{value: '{route_json}'}}\n  - name: ingest\n    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}\n    filter_chains:\n    - filters:\n      - name: wasm\n        typed_config:\n          config:\n            vm_config: {{vm_id: kvroute, code: {{local: {{filename: /etc/envoy/kvroute_filter.wasm}}}}}}\n            configuration: {{value: '{{\"role\":\"ingest\",\"ingest_token\":\"tok-0123456789abcdef\"}}'}}\n  clusters:\n  - name: c\n"
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
                Some(&envoy(443, r#"{"mode":"endpoint"}"#)),
            )
        };
        let r = on_443("https://envoy.example/kvroute/v1/snapshot");
        assert_eq!(r.errors(), 0, "{:?}", r.findings);
        assert_eq!(
            r.envoy_matched,
            vec!["ingest token", "ingest port", "ingest path"]
        );
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
            envoy_ok_suffix(&["clusters", "ingest token"]),
            "; matches the Envoy config (clusters, ingest token)"
        );
        assert_eq!(
            envoy_ok_suffix(&[]),
            "; nothing in the Envoy config to match (no cluster-mode filter, ingest port, ingest path or ingest token checked)"
        );
    }
}
