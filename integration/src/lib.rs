//! kvroute integration tools: the vLLM-compatible simulator ([`sim`]) and the harness that
//! starts real Envoy and backends for end-to-end tests ([`harness`]).

pub mod demo;
pub mod harness;
pub mod replay;
pub mod routebench;
pub mod sim;
