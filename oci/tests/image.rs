//! kvroute-cp's image: a hand-made 184-byte static x86-64 ELF packed as the binary; the
//! config (user, entrypoint, cmd, port, platform), every tar entry (path, type, mode, owner,
//! mtime, content) and every digest checked exactly; dynamically linked, non-x86-64 and
//! non-ELF inputs refused. With `KVROUTE_CP_BINARY` set (`make image` sets it to the musl
//! release build) the real binary is packed, unpacked and run with `--help`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{hex, read_layout, Entry};
use kvroute_oci::image::{build_layout, GROUP, PASSWD};
use kvroute_oci::OciError;
use serde_json::json;
use std::path::Path;

/// A minimal ELF64 little-endian executable: header, one `PT_LOAD` (and a `PT_INTERP` when
/// `interp`), then a 64-byte body. Layout per the System V gABI, "ELF Header" and "Program
/// Header" (<https://refspecs.linuxfoundation.org/elf/gabi4+/ch4.eheader.html>).
fn elf(machine: u16, interp: bool) -> Vec<u8> {
    let phnum: u16 = if interp { 2 } else { 1 };
    let mut b = Vec::new();
    b.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    b.extend_from_slice(&2u16.to_le_bytes()); // e_type ET_EXEC
    b.extend_from_slice(&machine.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes()); // e_version
    b.extend_from_slice(&0x40_1000u64.to_le_bytes()); // e_entry
    b.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    b.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    b.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    for v in [64u16, 56, phnum, 64, 0, 0] {
        // e_ehsize, e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx
        b.extend_from_slice(&v.to_le_bytes());
    }
    let mut ph = |p_type: u32, flags: u32| {
        b.extend_from_slice(&p_type.to_le_bytes());
        b.extend_from_slice(&flags.to_le_bytes());
        for v in [0u64, 0x40_0000, 0x40_0000, 184, 184, 0x1000] {
            // p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align
            b.extend_from_slice(&v.to_le_bytes());
        }
    };
    if interp {
        ph(3, 4); // PT_INTERP, R
    }
    ph(1, 5); // PT_LOAD, R+X
    b.resize(b.len() + 64, 0xcc);
    b
}

const EM_X86_64: u16 = 62;
const EM_AARCH64: u16 = 183;

fn dir(path: &str, mode: u32) -> Entry {
    Entry {
        path: path.into(),
        dir: true,
        mode,
        uid: 0,
        gid: 0,
        mtime: 0,
        content: vec![],
    }
}

fn file(path: &str, mode: u32, content: &[u8]) -> Entry {
    Entry {
        path: path.into(),
        dir: false,
        mode,
        uid: 0,
        gid: 0,
        mtime: 0,
        content: content.to_vec(),
    }
}

#[test]
fn image_of_a_small_static_binary() {
    let bin = elf(EM_X86_64, false);
    assert_eq!(bin.len(), 184);
    let out = tempfile::tempdir().unwrap();
    let (built, sha) = build_layout(&bin, out.path(), "0.1.0").unwrap();
    let r = read_layout(out.path(), "0.1.0", &built);

    assert_eq!(r.manifest.get("annotations"), None);
    assert_eq!(
        r.config,
        json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "User": "65532:65532",
                "ExposedPorts": {"9090/tcp": {}},
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                "Entrypoint": ["/usr/local/bin/kvroute-cp"],
                "Cmd": ["--config", "/etc/kvroute/kvroute-cp.yaml"]
            },
            "rootfs": {"type": "layers", "diff_ids": [built.diff_id]}
        })
    );
    assert_eq!(
        r.entries,
        vec![
            dir("etc/", 0o755),
            file("etc/group", 0o644, GROUP.as_bytes()),
            file("etc/passwd", 0o644, PASSWD.as_bytes()),
            dir("tmp/", 0o1777),
            dir("usr/", 0o755),
            dir("usr/local/", 0o755),
            dir("usr/local/bin/", 0o755),
            file("usr/local/bin/kvroute-cp", 0o755, &bin),
        ]
    );
    assert!(PASSWD.contains("\nnonroot:x:65532:65532:"));
    assert!(GROUP.contains("\nnonroot:x:65532:"));
    assert_eq!(sha, hex(&bin));

    // Pinned digests: any change to the layer's entries, the config or the manifest shows
    // here. The uncompressed tar and the config depend only on this crate; the gzip layer
    // (and so the manifest) also on flate2's miniz_oxide output, pinned by Cargo.lock.
    assert_eq!(
        (
            built.diff_id.as_str(),
            built.config_digest.as_str(),
            built.layer_digest.as_str(),
            built.manifest_digest.as_str(),
        ),
        (
            "sha256:c2ffbc5ff7a3644ce0c615e1473f3dac50350ff24a503bdbb53f378b562e5fac",
            "sha256:eacdd8d438303aa6a24e59f7473a6019220b8232d33db35d5fe98fc73d268f33",
            "sha256:6d04020bf8b17e64f0aada4881bf33d477f3c280ea52889802f198b04be1cf70",
            "sha256:18214bebd3652ec838cbffe2bc0b4f9ce331e500899e5238d0ca4a5422f831fc",
        )
    );

    // Reproducible: a second build gives the same digests.
    let out2 = tempfile::tempdir().unwrap();
    assert_eq!(build_layout(&bin, out2.path(), "0.1.0").unwrap().0, built);
}

#[test]
fn refuses_what_cannot_run_in_the_image() {
    let out = tempfile::tempdir().unwrap();
    let err = |b: &[u8]| match build_layout(b, out.path(), "t") {
        Err(OciError::NotStaticElf(why)) => why,
        other => panic!("expected NotStaticElf, got {other:?}"),
    };
    assert!(err(b"#!/bin/sh\n").starts_with("no 64-bit ELF header"));
    assert_eq!(
        err(&elf(EM_X86_64, true)),
        "dynamically linked (it names a program interpreter, PT_INTERP); \
         build --target x86_64-unknown-linux-musl"
    );
    assert_eq!(err(&elf(EM_AARCH64, false)), "machine 183, not x86-64 (62)");
    assert!(
        !out.path().join("index.json").exists(),
        "nothing written for a refused input"
    );
}

#[test]
fn the_real_binary_runs_from_the_unpacked_layer() {
    let Some(p) = std::env::var_os("KVROUTE_CP_BINARY").filter(|p| Path::new(p).exists()) else {
        eprintln!("KVROUTE_CP_BINARY not set or missing: skipped (make image runs it)");
        return;
    };
    let bin = std::fs::read(&p).unwrap();
    let out = tempfile::tempdir().unwrap();
    let (built, _) = build_layout(&bin, out.path(), "t").unwrap();
    let r = read_layout(out.path(), "t", &built);
    let root = tempfile::tempdir().unwrap();
    tar::Archive::new(r.layer_tar.as_slice())
        .unpack(root.path())
        .unwrap();
    let run = std::process::Command::new(root.path().join("usr/local/bin/kvroute-cp"))
        .arg("--help")
        .env_clear()
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "--help failed: {run:?}");
    assert!(stdout.contains("--config"), "{stdout}");
    eprintln!(
        "kvroute-cp: {} bytes, layer {} bytes, manifest {}",
        bin.len(),
        built.layer_size,
        built.manifest_digest
    );
}
