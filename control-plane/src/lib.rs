//! kvroute-cp: the control plane that scrapes model servers' Prometheus `/metrics` and
//! pushes KV-cache stats to every Envoy running the kvroute filter.
//!
//! Data flow: [`discovery`] yields endpoints → one [`scrape`] task per endpoint reads
//! `/metrics` ([`expo`] parses, [`adapters`] extract per server kind, [`restart`] detects
//! restarts) → the [`hub`] builds a versioned [`kvroute_core::snapshot::Snapshot`] on change
//! and every heartbeat → one [`push`] task per Envoy target POSTs it to the filter's ingest
//! route, each with the other gateways' in-flight load, read from their Envoy stats by
//! [`peers`]. [`server`] exposes `/healthz`, `/readyz`, `/metrics` ([`telemetry`]) and
//! `/v1/snapshot`. [`config`] is the YAML schema; [`app`] wires it all.

pub mod adapters;
pub mod app;
pub mod check;
pub mod config;
pub mod discovery;
pub mod expo;
pub mod files;
pub mod filewatch;
pub mod hub;
pub mod names;
pub mod peers;
pub mod push;
pub mod restart;
pub mod scrape;
pub mod server;
pub mod telemetry;
pub mod tls;
pub mod token;

pub use app::{ControlPlane, StartError};
pub use config::{Config, ConfigError};
