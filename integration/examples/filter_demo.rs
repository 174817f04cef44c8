//! One-command local run of the kvroute filter (`make demo-filter`): real Envoy with the
//! built `.wasm`, three recording backends as clusters `c0..c2`, one snapshot pushed through
//! the ingest listener, then requests routed by KV usage and prefix affinity.

use kvroute_core::snapshot::Snapshot;
use kvroute_integration::harness::kvroute::{chat, now_ms, Fleet, FleetOptions, TEST_TOKEN};

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let fleet = Fleet::start(FleetOptions {
        backends: 3,
        route_config: r#""picker":{"stale_after_ms":60000},"debug_header":true"#.into(),
        ..FleetOptions::default()
    })
    .await?;
    let now = now_ms();
    let snap = Snapshot::new(
        1,
        now,
        vec![
            fleet.endpoint(0, 0.92, now),
            fleet.endpoint(1, 0.35, now),
            fleet.endpoint(2, 0.10, now),
        ],
    );
    let r = fleet
        .ingest(&snap.encode(), Some("wrong-token-xxxxxxxx"))
        .await?;
    println!("ingest with a wrong token -> {} {}", r.status, r.text());
    let r = fleet.ingest(&snap.encode(), Some(TEST_TOKEN)).await?;
    println!(
        "ingest snapshot v1 (KV usage e0=0.92 e1=0.35 e2=0.10) -> {}",
        r.status
    );
    fleet.push(&snap).await?; // same version again: waits until the consumer has run
    for prompt in [
        "What is a KV cache?",
        "What is a KV cache?",
        "Explain prefill and decode.",
    ] {
        let r = fleet.post("/v1/chat/completions", &chat(prompt)).await?;
        println!(
            "POST /v1/chat/completions {:?} -> {} from {} ({})",
            prompt,
            r.status,
            r.header("x-backend").unwrap_or("?"),
            r.header("x-kvroute-decision").unwrap_or("?"),
        );
    }
    // A release reaches the shared counters with the worker's next reservation or tick
    // (at most 100 ms; docs/filter.md, "Request path").
    let made = fleet.custom("kvroute.reservations.reserved").await?;
    fleet
        .wait_stat_at_least(&["wasmcustom.kvroute.reservations.released"], made)
        .await?;
    println!(
        "reservations: {} made, {} released; wasm VM failures: {}",
        fleet.custom("kvroute.reservations.reserved").await?,
        fleet.custom("kvroute.reservations.released").await?,
        fleet.envoy.wasm_failures().await?.len()
    );
    Ok(())
}
