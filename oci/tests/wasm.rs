//! The filter's Wasm image (compat variant): built from a small module (and from the real
//! filter when `KVROUTE_WASM` names it); every link and digest checked by
//! [`common::read_layout`], the layer's single `plugin.wasm`, the compat annotation, the
//! wasm/wasip1 platform, reproducibility.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{hex, read_layout, Entry};
use kvroute_oci::wasm::build_layout;
use kvroute_oci::OciError;
use std::path::Path;

fn check(wasm: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let (built, sha) = build_layout(wasm, dir.path(), "v1").unwrap();
    let r = read_layout(dir.path(), "v1", &built);
    assert_eq!(
        r.manifest["annotations"],
        serde_json::json!({"module.wasm.image/variant": "compat"})
    );
    assert_eq!(r.config["architecture"], "wasm");
    assert_eq!(r.config["os"], "wasip1");
    assert_eq!(
        r.entries,
        vec![Entry {
            path: "plugin.wasm".into(),
            dir: false,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 0,
            content: wasm.to_vec(),
        }]
    );
    assert_eq!(sha, hex(wasm));

    // Reproducible: a second build gives the same digests.
    let dir2 = tempfile::tempdir().unwrap();
    assert_eq!(build_layout(wasm, dir2.path(), "v1").unwrap().0, built);
}

#[test]
fn layout_of_a_minimal_module() {
    // The smallest valid module: magic + version 1.
    check(b"\0asm\x01\0\0\0");
}

#[test]
fn layout_of_the_filter_when_built() {
    // `make test-k8s` sets KVROUTE_WASM to the release filter; skipped (and says so) without.
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
