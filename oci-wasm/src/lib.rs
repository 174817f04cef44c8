//! Pack a proxy-wasm module as an OCI image layout that Istio (`WasmPlugin` with an
//! `oci://` URL) and Envoy Gateway can pull, without a container daemon.
//!
//! Format: the *compat* variant of the Wasm image specification that Istio implements
//! (<https://github.com/solo-io/wasm/blob/master/spec/spec-compat.md>):
//! - exactly one layer, media type `application/vnd.oci.image.layer.v1.tar+gzip`, whose tar
//!   holds one file, `plugin.wasm`;
//! - the manifest annotation `module.wasm.image/variant: compat` (required by the spec for
//!   that layer media type);
//! - a standard image config (`application/vnd.oci.image.config.v1+json`) with
//!   `architecture: wasm`, `os: wasip1` (Go's names for the target, as the OCI image spec uses
//!   GOARCH/GOOS values) and the layer's uncompressed digest as `rootfs.diff_ids[0]`.
//!
//! The output is an OCI image layout directory (`oci-layout`, `index.json`, `blobs/sha256/`;
//! <https://github.com/opencontainers/image-spec/blob/v1.1.0/image-layout.md>) that
//! `skopeo copy oci:DIR:TAG docker://REGISTRY/IMAGE:TAG`, `oras cp --from-oci-layout` or
//! `crane push DIR` upload. Builds are reproducible: tar entry with mtime 0, uid/gid 0, mode
//! 0644; gzip header with mtime 0 and no file name; so the same `.wasm` always gives the
//! same digests.

use oci_spec::image::{
    Arch, Descriptor, DescriptorBuilder, Digest, ImageConfigurationBuilder, ImageIndexBuilder,
    ImageManifestBuilder, MediaType, OciLayoutBuilder, Os, RootFsBuilder,
};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::str::FromStr;

/// File name of the module inside the layer (compat variant).
pub const PLUGIN_FILE: &str = "plugin.wasm";
/// Manifest annotation key of the Wasm image variant.
pub const VARIANT_ANNOTATION: &str = "module.wasm.image/variant";
/// Value of [`VARIANT_ANNOTATION`].
pub const VARIANT_COMPAT: &str = "compat";
/// `index.json` annotation naming the tag (OCI image layout).
pub const REF_NAME_ANNOTATION: &str = "org.opencontainers.image.ref.name";

/// Why the layout could not be built.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The input is not a WebAssembly binary (`\0asm` magic missing).
    #[error("not a WebAssembly module (no \\0asm header)")]
    NotWasm,
    /// Writing the layout failed.
    #[error("{path}: {source}")]
    Io {
        /// Path written.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// oci-spec refused a document.
    #[error("OCI document: {0}")]
    Spec(#[from] oci_spec::OciSpecError),
}

/// What was written: the digests, for logs and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Built {
    /// `sha256:...` of the manifest (the image digest to pin in `WasmPlugin.spec.sha256`
    /// is NOT this; see [`Built::wasm_sha256`]).
    pub manifest_digest: String,
    /// `sha256:...` of the config blob.
    pub config_digest: String,
    /// `sha256:...` of the gzipped layer.
    pub layer_digest: String,
    /// `sha256:...` of the uncompressed layer tar (`rootfs.diff_ids[0]`).
    pub diff_id: String,
    /// Hex sha256 of `plugin.wasm` itself: the value of Istio's `WasmPlugin.spec.sha256`.
    pub wasm_sha256: String,
}

fn sha256_hex(b: &[u8]) -> String {
    let d = Sha256::digest(b);
    d.iter().map(|x| format!("{x:02x}")).collect()
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> OciError + '_ {
    move |source| OciError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The uncompressed layer: a tar with `plugin.wasm` only.
pub fn layer_tar(wasm: &[u8]) -> Result<Vec<u8>, std::io::Error> {
    let mut b = tar::Builder::new(Vec::new());
    b.mode(tar::HeaderMode::Deterministic);
    let mut h = tar::Header::new_ustar();
    h.set_size(wasm.len() as u64);
    h.set_mode(0o644);
    h.set_mtime(0);
    h.set_uid(0);
    h.set_gid(0);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, PLUGIN_FILE, wasm)?;
    b.into_inner()
}

/// Gzip with a fixed header (mtime 0, no name), so equal input gives equal bytes.
pub fn gzip(data: &[u8]) -> Result<Vec<u8>, std::io::Error> {
    let mut e = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::best());
    e.write_all(data)?;
    e.finish()
}

fn write_blob(dir: &Path, data: &[u8]) -> Result<String, OciError> {
    let hex = sha256_hex(data);
    let blobs = dir.join("blobs").join("sha256");
    std::fs::create_dir_all(&blobs).map_err(io(&blobs))?;
    let p = blobs.join(&hex);
    std::fs::write(&p, data).map_err(io(&p))?;
    Ok(format!("sha256:{hex}"))
}

fn descriptor(media: MediaType, digest: &str, size: usize) -> Result<Descriptor, OciError> {
    Ok(DescriptorBuilder::default()
        .media_type(media)
        .digest(Digest::from_str(digest)?)
        .size(size as u64)
        .build()?)
}

/// Write the OCI image layout for `wasm` into `dir` (created if missing), tagged `tag`.
/// An existing layout in `dir` is replaced (its `index.json` is rewritten; stale blobs are
/// left, harmless to every reader).
pub fn build_layout(wasm: &[u8], dir: &Path, tag: &str) -> Result<Built, OciError> {
    if !wasm.starts_with(b"\0asm") {
        return Err(OciError::NotWasm);
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tar = layer_tar(wasm).map_err(io(dir))?;
    let diff_id = format!("sha256:{}", sha256_hex(&tar));
    let layer = gzip(&tar).map_err(io(dir))?;
    let layer_digest = write_blob(dir, &layer)?;

    let rootfs = RootFsBuilder::default()
        .typ("layers")
        .diff_ids(vec![diff_id.clone()])
        .build()?;
    let config = ImageConfigurationBuilder::default()
        .architecture(Arch::Wasm)
        .os(Os::Other("wasip1".into()))
        .rootfs(rootfs)
        .build()?;
    let config_json = config.to_string()?;
    let config_digest = write_blob(dir, config_json.as_bytes())?;

    let manifest = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .config(descriptor(
            MediaType::ImageConfig,
            &config_digest,
            config_json.len(),
        )?)
        .layers(vec![descriptor(
            MediaType::ImageLayerGzip,
            &layer_digest,
            layer.len(),
        )?])
        .annotations(HashMap::from([(
            VARIANT_ANNOTATION.to_string(),
            VARIANT_COMPAT.to_string(),
        )]))
        .build()?;
    let manifest_json = manifest.to_string()?;
    let manifest_digest = write_blob(dir, manifest_json.as_bytes())?;

    let mut m = descriptor(
        MediaType::ImageManifest,
        &manifest_digest,
        manifest_json.len(),
    )?;
    m.set_annotations(Some(HashMap::from([(
        REF_NAME_ANNOTATION.to_string(),
        tag.to_string(),
    )])));
    let index = ImageIndexBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageIndex)
        .manifests(vec![m])
        .build()?;
    let index_path = dir.join("index.json");
    std::fs::write(&index_path, index.to_string()?).map_err(io(&index_path))?;
    let layout = OciLayoutBuilder::default()
        .image_layout_version("1.0.0")
        .build()?;
    let layout_path = dir.join("oci-layout");
    std::fs::write(
        &layout_path,
        serde_json::to_string(&layout).map_err(|e| io(&layout_path)(e.into()))?,
    )
    .map_err(io(&layout_path))?;
    Ok(Built {
        manifest_digest,
        config_digest,
        layer_digest,
        diff_id,
        wasm_sha256: sha256_hex(wasm),
    })
}
