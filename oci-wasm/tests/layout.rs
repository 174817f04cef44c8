//! Build the layout from a small module (and from the real filter when `KVROUTE_WASM`
//! names it) and check every link: index → manifest → config and layer, each blob's sha256
//! equal to its digest and its size to the descriptor, the layer a gzip tar holding exactly
//! `plugin.wasm` with the input bytes, `rootfs.diff_ids[0]` the uncompressed tar's digest,
//! and the compat-variant annotation.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_oci_wasm::{build_layout, OciError};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

fn hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn blob(dir: &Path, desc: &Value) -> Vec<u8> {
    let digest = desc["digest"].as_str().unwrap();
    let h = digest.strip_prefix("sha256:").unwrap();
    let b = std::fs::read(dir.join("blobs/sha256").join(h)).unwrap();
    assert_eq!(hex(&b), h, "blob content matches its digest");
    assert_eq!(
        desc["size"].as_u64().unwrap(),
        b.len() as u64,
        "descriptor size"
    );
    b
}

fn check(wasm: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let built = build_layout(wasm, dir.path(), "v1").unwrap();
    let layout: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("oci-layout")).unwrap()).unwrap();
    assert_eq!(layout, serde_json::json!({"imageLayoutVersion": "1.0.0"}));
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("index.json")).unwrap()).unwrap();
    assert_eq!(index["schemaVersion"], 2);
    assert_eq!(index["manifests"].as_array().unwrap().len(), 1);
    let mdesc = &index["manifests"][0];
    assert_eq!(
        mdesc["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        mdesc["annotations"]["org.opencontainers.image.ref.name"],
        "v1"
    );
    assert_eq!(mdesc["digest"], built.manifest_digest.as_str());
    let manifest: Value = serde_json::from_slice(&blob(dir.path(), mdesc)).unwrap();
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        manifest["annotations"]["module.wasm.image/variant"],
        "compat"
    );
    assert_eq!(
        manifest["config"]["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    assert_eq!(manifest["config"]["digest"], built.config_digest.as_str());
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "compat variant: exactly one layer");
    assert_eq!(
        layers[0]["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
    assert_eq!(layers[0]["digest"], built.layer_digest.as_str());

    let config: Value = serde_json::from_slice(&blob(dir.path(), &manifest["config"])).unwrap();
    assert_eq!(config["architecture"], "wasm");
    assert_eq!(config["os"], "wasip1");
    assert_eq!(config["rootfs"]["type"], "layers");
    assert_eq!(config["rootfs"]["diff_ids"][0], built.diff_id.as_str());

    let gz = blob(dir.path(), &layers[0]);
    let mut tar_bytes = Vec::new();
    flate2::read::GzDecoder::new(gz.as_slice())
        .read_to_end(&mut tar_bytes)
        .unwrap();
    assert_eq!(format!("sha256:{}", hex(&tar_bytes)), built.diff_id);
    let mut ar = tar::Archive::new(tar_bytes.as_slice());
    let mut entries = Vec::new();
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let path = e.path().unwrap().display().to_string();
        let mut content = Vec::new();
        e.read_to_end(&mut content).unwrap();
        entries.push((path, e.header().mode().unwrap(), content));
    }
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].0, "plugin.wasm");
    assert_eq!(entries[0].1, 0o644);
    assert!(entries[0].2 == wasm, "plugin.wasm holds the input bytes");
    assert_eq!(built.wasm_sha256, hex(wasm));

    // Reproducible: a second build gives the same digests.
    let dir2 = tempfile::tempdir().unwrap();
    assert_eq!(build_layout(wasm, dir2.path(), "v1").unwrap(), built);
}

#[test]
fn layout_of_a_minimal_module() {
    // The smallest valid module: magic + version 1.
    check(b"\0asm\x01\0\0\0");
}

#[test]
fn layout_of_the_filter_when_built() {
    // `make test-oci` sets KVROUTE_WASM to the release filter; skipped (and says so) without.
    match std::env::var("KVROUTE_WASM") {
        Ok(p) if Path::new(&p).exists() => check(&std::fs::read(p).unwrap()),
        _ => eprintln!("KVROUTE_WASM not set or missing: only the minimal module was packed"),
    }
}

#[test]
fn refuses_a_non_wasm_file() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        build_layout(b"#!/bin/sh\n", dir.path(), "v1"),
        Err(OciError::NotWasm)
    ));
}
