//! Envoy config templates for the end-to-end tests, and cluster snippets to fill them.
//!
//! Placeholders (all required, see [`super::render`]): `LISTEN_PORT`, `INGEST_PORT`,
//! `BUFFER_LIMIT` (bytes), `ROUTE_FILTER` and `INGEST_FILTER` (the kvroute filter of each
//! listener, from [`kvroute_filters`]: the Wasm build or a native dynamic module, with the
//! route and ingest plugins' JSON), `CLUSTERS` (from [`static_cluster`] /
//! [`override_host_cluster`] / [`original_dst_cluster`]); cluster mode also
//! `CLUSTER_HEADER` and `DEFAULT_CLUSTER` (the route used when the filter sets no header);
//! endpoint mode also `POOL_TYPE` (a comment only). The admin port is 0 (OS-chosen, read
//! back by [`super::Envoy`]).

use std::path::Path;

/// Where Envoy takes the kvroute filter from; the rest of a config does not depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterModule<'a> {
    /// The proxy-wasm build (`kvroute_filter.wasm`) at this path, run by V8. The route and
    /// ingest filters share one VM (`vm_id: kvroute`); the route filter fails open.
    Wasm(&'a Path),
    /// A native Envoy dynamic module (`DynamicModuleFilter`). Envoy loads `lib<name>.so`
    /// from the directories of `ENVOY_DYNAMIC_MODULES_SEARCH_PATH` (set for the Envoy
    /// process, not in the config); `filter_name` is the filter the module implements, and
    /// the module picks the role from the plugin config, as the Wasm filter does.
    DynamicModule {
        /// The module's name: `kvroute` for `libkvroute.so`.
        name: &'a str,
        /// The module's filter name.
        filter_name: &'a str,
    },
}

/// One `http_filters` item running kvroute from `module` with plugin configuration
/// `config` (JSON, one line, no single quotes), indented for [`CLUSTER_MODE`] and
/// [`ENDPOINT_MODE`]; `ingest` picks the ingest listener's filter (its own name, never
/// fail-open) over the route listener's.
pub fn kvroute_filter(module: FilterModule<'_>, ingest: bool, config: &str) -> String {
    match module {
        FilterModule::Wasm(wasm) => {
            let (name, fail_open) = if ingest {
                ("kvroute-ingest", "")
            } else {
                ("kvroute", "\n                failure_policy: FAIL_OPEN")
            };
            format!(
                r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: {name}
                root_id: kvroute{fail_open}
                allow_on_headers_stop_iteration: true
                vm_config:
                  vm_id: kvroute
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{}"}}}}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{config}'"#,
                wasm.display()
            )
        }
        FilterModule::DynamicModule { name, filter_name } => format!(
            r#"          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: {{name: {name}, do_not_close: true}}
              filter_name: {filter_name}
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: '{config}'"#
        ),
    }
}

/// The `ROUTE_FILTER` and `INGEST_FILTER` values of [`CLUSTER_MODE`] and [`ENDPOINT_MODE`]:
/// [`kvroute_filter`] from `module` with the route plugin's JSON `route_config` and the
/// ingest plugin's `ingest_config`.
pub fn kvroute_filters(
    module: FilterModule<'_>,
    route_config: &str,
    ingest_config: &str,
) -> [(&'static str, String); 2] {
    [
        ("ROUTE_FILTER", kvroute_filter(module, false, route_config)),
        ("INGEST_FILTER", kvroute_filter(module, true, ingest_config)),
    ]
}

/// Cluster mode: the route's `cluster_header` picks the Envoy cluster.
pub const CLUSTER_MODE: &str = include_str!("templates/cluster_mode.yaml");
/// Endpoint mode: route to cluster `pool`, whose load balancer reads
/// `x-gateway-destination-endpoint`; retries move to the next host.
pub const ENDPOINT_MODE: &str = include_str!("templates/endpoint_mode.yaml");

/// Baseline without the filter (placeholders `LISTEN_PORT`, `DEFAULT_CLUSTER`, `CLUSTERS`),
/// for latency comparisons.
pub const PLAIN: &str = include_str!("templates/plain.yaml");

fn socket(addr: &str) -> String {
    let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "0"));
    let host = host.trim_start_matches('[').trim_end_matches(']');
    format!("{{endpoint: {{address: {{socket_address: {{address: \"{host}\", port_value: {port}}}}}}}}}")
}

fn lb_endpoints(addrs: &[String]) -> String {
    addrs
        .iter()
        .map(|a| format!("        - {}\n", socket(a)))
        .collect()
}

/// A STATIC cluster `name` over `addrs` (`host:port`, IPv6 bracketed), round robin.
pub fn static_cluster(name: &str, addrs: &[String]) -> String {
    format!(
        "  - name: {name}\n    type: STATIC\n    connect_timeout: 1s\n    load_assignment:\n      cluster_name: {name}\n      endpoints:\n      - lb_endpoints:\n{}",
        lb_endpoints(addrs)
    )
}

/// Cluster mode's clusters: `c0`, `c1`, ... one per address of `addrs`, in order (the
/// clusters kvroute-cp's endpoints name), each a [`static_cluster`].
pub fn per_endpoint_clusters(addrs: &[String]) -> String {
    addrs
        .iter()
        .enumerate()
        .map(|(i, a)| static_cluster(&format!("c{i}"), std::slice::from_ref(a)))
        .collect()
}

/// A STATIC cluster `pool` whose load-balancing policy is
/// `envoy.load_balancing_policies.override_host` reading `header` (an ordered host list),
/// falling back to round robin when the header is absent or names no known host.
pub fn override_host_cluster(header: &str, addrs: &[String]) -> String {
    format!(
        r#"  - name: pool
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:
{}    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: {header}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
"#,
        lb_endpoints(addrs)
    )
}

/// An ORIGINAL_DST cluster `pool` that takes its destination from `header` (one
/// `host:port` only).
pub fn original_dst_cluster(header: &str) -> String {
    format!(
        "  - name: pool\n    type: ORIGINAL_DST\n    lb_policy: CLUSTER_PROVIDED\n    connect_timeout: 1s\n    original_dst_lb_config:\n      use_http_header: true\n      http_header_name: {header}\n"
    )
}

/// Benchmark floor (`make bench-overhead`): the plain listener plus one body-reading filter
/// that does nothing else, [`floor_filter`] (placeholders `LISTEN_PORT`, `BUFFER_LIMIT`,
/// `FLOOR_FILTER`, `DEFAULT_CLUSTER`, `CLUSTERS`).
pub const FLOOR: &str = include_str!("templates/floor.yaml");

/// The filter of a benchmark floor ([`FLOOR`]'s `FLOOR_FILTER`).
#[derive(Debug, Clone, Copy)]
pub enum Floor<'a> {
    /// `bench/floor-filter`'s `.wasm` at this path, run by V8 like kvroute's: it pauses until
    /// the body is whole and copies it into the VM once (the Wasm build's floor).
    Wasm(&'a Path),
    /// Envoy's own buffer filter (C++), holding the request until the body is whole, up to
    /// `max_request_bytes` (the native build's floor: no VM).
    EnvoyBuffer {
        /// `max_request_bytes`.
        max_request_bytes: usize,
    },
}

/// The `http_filters` item of `floor`, indented for [`FLOOR`]'s `FLOOR_FILTER` (no trailing
/// newline, as [`kvroute_filter`]'s).
pub fn floor_filter(floor: Floor<'_>) -> String {
    match floor {
        Floor::Wasm(wasm) => format!(
            r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: floor
                root_id: floor
                failure_policy: FAIL_OPEN
                allow_on_headers_stop_iteration: true
                vm_config:
                  vm_id: floor
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{}"}}}}"#,
            wasm.display()
        ),
        Floor::EnvoyBuffer { max_request_bytes } => format!(
            r#"          - name: envoy.filters.http.buffer
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
              max_request_bytes: {max_request_bytes}"#
        ),
    }
}

/// Benchmark backend (`make bench-overhead`): Envoy reading each request body whole, then
/// answering `REPLY` (JSON, no single quotes) itself (placeholders `LISTEN_PORT`,
/// `BUFFER_LIMIT`, `REPLY`).
pub const DIRECT_RESPONSE: &str = include_str!("templates/direct_response.yaml");

/// Module name of the native build (`libkvroute_dynmod.so`, `make dynmod`), as
/// `dynamic_module_config.name` names it; Envoy finds the file through
/// `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`.
pub const DYNMOD_NAME: &str = "kvroute_dynmod";

/// Prefix of the module's stats in `/stats` (where the Wasm filter's have `wasmcustom.`).
pub const DYNMOD_STAT_PREFIX: &str = "dynamicmodulescustom.";

/// The native build as the harness loads it: module [`DYNMOD_NAME`], filter `kvroute`
/// (the module serves both roles under any filter name; the plugin config's `role` picks).
/// Its stats are under Envoy's default dynamic-module namespace, [`DYNMOD_STAT_PREFIX`]
/// (Envoy 1.40 has no `metrics_namespace` field to change it).
pub const DYNMOD: FilterModule<'static> = FilterModule::DynamicModule {
    name: DYNMOD_NAME,
    filter_name: "kvroute",
};
