//! `kvroute-oci`: write kvroute's images as OCI image layouts for `skopeo`/`oras`/`crane` to
//! push, with no container daemon. `kvroute-oci wasm`: the filter (Wasm image spec, compat
//! variant). `kvroute-oci image`: kvroute-cp (a static binary in a one-layer Linux image).

use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// Pack kvroute's images as OCI image layouts.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    #[command(subcommand)]
    what: What,
    /// Output directory (OCI image layout).
    #[arg(long, global = true, default_value = "oci-layout")]
    out: PathBuf,
    /// Tag recorded in index.json (`org.opencontainers.image.ref.name`).
    #[arg(long, global = true, default_value = "latest")]
    tag: String,
}

#[derive(Debug, Subcommand)]
enum What {
    /// The filter as a Wasm image (Istio `WasmPlugin` / Envoy Gateway, compat variant).
    Wasm {
        /// The proxy-wasm module.
        #[arg(long)]
        wasm: PathBuf,
    },
    /// kvroute-cp as a linux/amd64 image running as 65532:65532.
    Image {
        /// The static (x86_64-unknown-linux-musl) kvroute-cp binary.
        #[arg(long)]
        binary: PathBuf,
    },
}

fn read(p: &PathBuf) -> anyhow::Result<Vec<u8>> {
    std::fs::read(p).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let (built, file, sha) = match &a.what {
        What::Wasm { wasm } => {
            let (b, sha) = kvroute_oci::wasm::build_layout(&read(wasm)?, &a.out, &a.tag)?;
            (b, "plugin.wasm", sha)
        }
        What::Image { binary } => {
            let bytes = read(binary)?;
            let (b, sha) = kvroute_oci::image::build_layout(&bytes, &a.out, &a.tag)?;
            println!("binary    {} bytes", bytes.len());
            (b, "kvroute-cp", sha)
        }
    };
    println!("OCI layout: {} (tag {})", a.out.display(), a.tag);
    println!("manifest  {}", built.manifest_digest);
    println!("config    {}", built.config_digest);
    println!(
        "layer     {} ({} bytes; diff_id {})",
        built.layer_digest, built.layer_size, built.diff_id
    );
    match a.what {
        What::Wasm { .. } => println!("{file} sha256 {sha}  (WasmPlugin.spec.sha256)"),
        What::Image { .. } => println!("{file} sha256 {sha}"),
    }
    Ok(())
}
