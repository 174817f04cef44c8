//! Write OCI image layouts without a container daemon: the kvroute filter as a Wasm image
//! ([`wasm`]) and kvroute-cp as a runnable single-layer Linux image ([`image`]).
//!
//! Both go through one writer, [`write_layout`]: one gzip layer, one image config, one
//! manifest, in an OCI image layout directory (`oci-layout`, `index.json`, `blobs/sha256/`;
//! <https://github.com/opencontainers/image-spec/blob/v1.1.0/image-layout.md>) that
//! `skopeo copy oci:DIR:TAG docker://REGISTRY/IMAGE:TAG`, `oras cp --from-oci-layout` or
//! `crane push DIR` upload.
//!
//! Builds are reproducible: tar entries carry mtime 0 and fixed owners and modes
//! ([`TarEntry`]), the gzip header has mtime 0 and no file name, and no document carries a
//! creation time or more than one map key (serde writes `HashMap`s in random order), so equal
//! input gives equal digests.

pub mod image;
pub mod wasm;

use oci_spec::image::{
    Descriptor, DescriptorBuilder, Digest, ImageConfiguration, ImageIndexBuilder,
    ImageManifestBuilder, MediaType, OciLayoutBuilder, RootFsBuilder,
};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::str::FromStr;

/// `index.json` annotation naming the tag (OCI image layout).
pub const REF_NAME_ANNOTATION: &str = "org.opencontainers.image.ref.name";

/// Why the layout could not be built.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The input is not a WebAssembly binary (`\0asm` magic missing).
    #[error("not a WebAssembly module (no \\0asm header)")]
    NotWasm,
    /// The input is not a static x86-64 Linux executable (see [`image::check_static_elf`]).
    #[error("not a static x86-64 ELF executable: {0}")]
    NotStaticElf(String),
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
    /// `sha256:...` of the manifest (what `skopeo inspect` shows as the image digest).
    pub manifest_digest: String,
    /// `sha256:...` of the config blob.
    pub config_digest: String,
    /// `sha256:...` of the gzipped layer.
    pub layer_digest: String,
    /// Size of the gzipped layer, bytes.
    pub layer_size: u64,
    /// `sha256:...` of the uncompressed layer tar (`rootfs.diff_ids[0]`).
    pub diff_id: String,
}

/// One entry of a layer tar. Owner, mode and mtime (0) are fixed, never taken from the disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TarEntry<'a> {
    /// Path inside the image, relative (`usr/local/bin/kvroute-cp`); directories end in `/`.
    pub path: &'a str,
    /// Permission bits (`0o755`, `0o644`, `0o1777`).
    pub mode: u32,
    /// File content; `None` for a directory.
    pub data: Option<&'a [u8]>,
}

/// Hex sha256 of `b`.
pub fn sha256_hex(b: &[u8]) -> String {
    let d = Sha256::digest(b);
    d.iter().map(|x| format!("{x:02x}")).collect()
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> OciError + '_ {
    move |source| OciError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The uncompressed layer: `entries` in order (parents before children), owned by 0:0,
/// mtime 0.
pub fn layer_tar(entries: &[TarEntry<'_>]) -> Result<Vec<u8>, std::io::Error> {
    let mut b = tar::Builder::new(Vec::new());
    b.mode(tar::HeaderMode::Deterministic);
    for e in entries {
        let mut h = tar::Header::new_ustar();
        h.set_mode(e.mode);
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        match e.data {
            Some(data) => {
                h.set_size(data.len() as u64);
                h.set_entry_type(tar::EntryType::Regular);
                b.append_data(&mut h, e.path, data)?;
            }
            None => {
                h.set_size(0);
                h.set_entry_type(tar::EntryType::Directory);
                b.append_data(&mut h, e.path, std::io::empty())?;
            }
        }
    }
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

/// Write a single-layer OCI image layout into `dir` (created if missing), tagged `tag`.
///
/// `entries` become the layer (`application/vnd.oci.image.layer.v1.tar+gzip`); `config` is
/// completed with `rootfs` (`layers`, the tar's digest as the only diff_id) and stored as the
/// image config; `annotations` go on the manifest (at most one key keeps the bytes
/// reproducible). An existing layout in `dir` is replaced: `index.json` is rewritten, stale
/// blobs are left (harmless to every reader).
pub fn write_layout(
    dir: &Path,
    tag: &str,
    entries: &[TarEntry<'_>],
    mut config: ImageConfiguration,
    annotations: Option<HashMap<String, String>>,
) -> Result<Built, OciError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tar = layer_tar(entries).map_err(io(dir))?;
    let diff_id = format!("sha256:{}", sha256_hex(&tar));
    let layer = gzip(&tar).map_err(io(dir))?;
    let layer_digest = write_blob(dir, &layer)?;

    config.set_rootfs(
        RootFsBuilder::default()
            .typ("layers")
            .diff_ids(vec![diff_id.clone()])
            .build()?,
    );
    let config_json = config.to_string()?;
    let config_digest = write_blob(dir, config_json.as_bytes())?;

    let mut manifest = ImageManifestBuilder::default()
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
        .build()?;
    manifest.set_annotations(annotations);
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
        layer_size: layer.len() as u64,
        diff_id,
    })
}
