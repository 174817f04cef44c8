//! Read an OCI image layout back and check every link: index → manifest → config and layer,
//! each blob's sha256 equal to its digest and its size to its descriptor, the layer a gzip
//! tar whose uncompressed sha256 is `rootfs.diff_ids[0]`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    dead_code
)]

use kvroute_oci::Built;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

pub fn hex(b: &[u8]) -> String {
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

/// One tar entry as read back.
#[derive(Debug, PartialEq, Eq)]
pub struct Entry {
    pub path: String,
    pub dir: bool,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: u64,
    pub content: Vec<u8>,
}

/// What a layout holds, after every digest and size was checked.
pub struct Layout {
    pub manifest: Value,
    pub config: Value,
    pub entries: Vec<Entry>,
    /// The gzipped layer, for unpacking.
    pub layer_tar: Vec<u8>,
}

/// Read the layout in `dir`, tagged `tag`, that `built` describes.
pub fn read_layout(dir: &Path, tag: &str, built: &Built) -> Layout {
    let layout: Value =
        serde_json::from_slice(&std::fs::read(dir.join("oci-layout")).unwrap()).unwrap();
    assert_eq!(layout, serde_json::json!({"imageLayoutVersion": "1.0.0"}));
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    assert_eq!(index["schemaVersion"], 2);
    assert_eq!(
        index["mediaType"],
        "application/vnd.oci.image.index.v1+json"
    );
    assert_eq!(index["manifests"].as_array().unwrap().len(), 1);
    let mdesc = &index["manifests"][0];
    assert_eq!(
        mdesc["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        mdesc["annotations"]["org.opencontainers.image.ref.name"],
        tag
    );
    assert_eq!(mdesc["digest"], built.manifest_digest.as_str());
    let manifest: Value = serde_json::from_slice(&blob(dir, mdesc)).unwrap();
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        manifest["config"]["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    assert_eq!(manifest["config"]["digest"], built.config_digest.as_str());
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "one layer");
    assert_eq!(
        layers[0]["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
    assert_eq!(layers[0]["digest"], built.layer_digest.as_str());
    assert_eq!(layers[0]["size"], built.layer_size);

    let config: Value = serde_json::from_slice(&blob(dir, &manifest["config"])).unwrap();
    assert_eq!(config["rootfs"]["type"], "layers");
    assert_eq!(
        config["rootfs"]["diff_ids"],
        serde_json::json!([built.diff_id])
    );

    let gz = blob(dir, &layers[0]);
    let mut tar_bytes = Vec::new();
    flate2::read::GzDecoder::new(gz.as_slice())
        .read_to_end(&mut tar_bytes)
        .unwrap();
    assert_eq!(format!("sha256:{}", hex(&tar_bytes)), built.diff_id);
    let mut ar = tar::Archive::new(tar_bytes.as_slice());
    let mut entries = Vec::new();
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let h = e.header().clone();
        let mut content = Vec::new();
        e.read_to_end(&mut content).unwrap();
        entries.push(Entry {
            path: e.path().unwrap().display().to_string(),
            dir: h.entry_type().is_dir(),
            mode: h.mode().unwrap(),
            uid: h.uid().unwrap(),
            gid: h.gid().unwrap(),
            mtime: h.mtime().unwrap(),
            content,
        });
    }
    Layout {
        manifest,
        config,
        entries,
        layer_tar: tar_bytes,
    }
}
