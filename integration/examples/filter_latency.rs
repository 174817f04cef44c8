//! Latency added by the kvroute filter, measured against real Envoy (`make bench-filter`).
//!
//! Same backends, same client, same request bodies (the shared OpenAI request fixtures,
//! cycled), sequential requests over fresh connections:
//! - **plain**: Envoy with the router only;
//! - **kvroute**: Envoy with the filter (hybrid policy, fresh snapshot of 4 endpoints),
//!   which buffers and analyses each body, picks, reserves and releases.
//!
//! Prints p50/p90/p99 in microseconds for both and their ratio.

use kvroute_core::snapshot::Snapshot;
use kvroute_integration::harness::kvroute::{now_ms, Fleet, FleetOptions};
use kvroute_integration::harness::{free_port, http, render, templates, Envoy};
use std::time::Instant;

const N: usize = 400;

/// Nearest-rank percentile ([`kvroute_core::percentile`]) of `v`, sorted in place.
fn pct(v: &mut [u128], p: f64) -> u128 {
    v.sort_unstable();
    kvroute_core::percentile::nearest_rank(v, p).unwrap_or(0)
}

async fn run(port: u16, bodies: &[(String, Vec<u8>)]) -> anyhow::Result<Vec<u128>> {
    let mut out = Vec::with_capacity(N);
    for i in 0..N + 20 {
        let (path, body) = bodies
            .get(i % bodies.len())
            .ok_or_else(|| anyhow::anyhow!("no bodies"))?;
        let url = format!("http://127.0.0.1:{port}{path}");
        let t = Instant::now();
        let r = http::request("POST", &url, &[("content-type", "application/json")], body).await?;
        anyhow::ensure!(r.status == 200, "status {}", r.status);
        if i >= 20 {
            out.push(t.elapsed().as_micros());
        }
    }
    Ok(out)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let dir = kvroute_core::shared_data::dir().join("requests");
    let mut bodies = Vec::new();
    let mut models = vec!["m".to_string()];
    let mut files: Vec<_> = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    for f in files {
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !name.contains("_chat_") {
            continue;
        }
        let body = std::fs::read(&f)?;
        if let Some(m) = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("model")?.as_str().map(str::to_owned))
        {
            models.push(m);
        }
        bodies.push(("/v1/chat/completions".to_string(), body));
    }
    let fleet = Fleet::start(FleetOptions {
        backends: 4,
        route_config: r#""picker":{"stale_after_ms":600000}"#.into(),
        ..FleetOptions::default()
    })
    .await?;
    let now = now_ms();
    let eps = (0..4)
        .map(|i| {
            let mut e = fleet.endpoint(i, 0.2 + 0.1 * i as f64, now);
            e.models = models.clone();
            e
        })
        .collect();
    fleet.push(&Snapshot::new(1, now, eps)).await?;
    let addrs: Vec<String> = fleet.backends.iter().map(|b| b.address()).collect();
    let plain_port = free_port()?;
    let plain = Envoy::start(
        &render(
            templates::PLAIN,
            &[
                ("LISTEN_PORT", plain_port.to_string()),
                ("DEFAULT_CLUSTER", "default".into()),
                ("CLUSTERS", templates::static_cluster("default", &addrs)),
            ],
        )?,
        1,
    )
    .await?;
    let mut a = run(plain_port, &bodies).await?;
    let mut b = run(fleet.port, &bodies).await?;
    let _ = &plain;
    println!(
        "{N} sequential chat requests ({} shared bodies, cycled), latency in µs:",
        bodies.len()
    );
    println!("{:<10} {:>8} {:>8} {:>8}", "", "p50", "p90", "p99");
    let (a50, a90, a99) = (pct(&mut a, 0.5), pct(&mut a, 0.9), pct(&mut a, 0.99));
    let (b50, b90, b99) = (pct(&mut b, 0.5), pct(&mut b, 0.9), pct(&mut b, 0.99));
    println!("{:<10} {a50:>8} {a90:>8} {a99:>8}", "plain");
    println!("{:<10} {b50:>8} {b90:>8} {b99:>8}", "kvroute");
    let r = |x: u128, y: u128| x as f64 / y.max(1) as f64;
    println!(
        "{:<10} {:>8.2} {:>8.2} {:>8.2}",
        "ratio",
        r(b50, a50),
        r(b90, a90),
        r(b99, a99)
    );
    // Histograms reach /stats at Envoy's stats flush (every 5 s by default).
    tokio::time::sleep(std::time::Duration::from_millis(5500)).await;
    let h = http::request(
        "GET",
        &format!(
            "http://{}/stats?filter=kvroute.decision_us",
            fleet.envoy.admin()
        ),
        &[],
        b"",
    )
    .await?;
    // Envoy prints histogram quantiles as `P50(interval,cumulative)`.
    for line in h.text().lines() {
        println!("filter decision time (µs, Envoy histogram): {line}");
    }
    println!(
        "decisions by policy: {}, parse errors: {}",
        fleet.custom("kvroute.decisions.policy").await?,
        fleet.custom("kvroute.parse_errors").await?
    );
    Ok(())
}
