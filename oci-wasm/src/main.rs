//! `kvroute-oci-wasm`: write the filter as an OCI image layout (Wasm image spec, compat
//! variant) for `skopeo`/`oras`/`crane` to push. No container daemon needed.

use clap::Parser;
use std::path::PathBuf;

/// Pack a .wasm as an OCI image layout (Istio/Envoy Gateway Wasm image, compat variant).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The proxy-wasm module.
    #[arg(long)]
    wasm: PathBuf,
    /// Output directory (OCI image layout).
    #[arg(long)]
    out: PathBuf,
    /// Tag recorded in index.json (`org.opencontainers.image.ref.name`).
    #[arg(long, default_value = "latest")]
    tag: String,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let wasm = std::fs::read(&a.wasm)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", a.wasm.display()))?;
    let b = kvroute_oci_wasm::build_layout(&wasm, &a.out, &a.tag)?;
    println!("OCI layout: {} (tag {})", a.out.display(), a.tag);
    println!("manifest  {}", b.manifest_digest);
    println!("config    {}", b.config_digest);
    println!("layer     {} (diff_id {})", b.layer_digest, b.diff_id);
    println!(
        "plugin.wasm sha256 {}  (WasmPlugin.spec.sha256)",
        b.wasm_sha256
    );
    Ok(())
}
