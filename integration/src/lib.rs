//! kvroute integration tools: the vLLM-compatible simulator ([`sim`]), the harness that
//! starts real Envoy and backends for end-to-end tests ([`harness`]), and the data-plane
//! overhead benchmark ([`overhead`]).

pub mod demo;
pub mod harness;
pub mod overhead;
pub mod replay;
pub mod routebench;
pub mod sim;
