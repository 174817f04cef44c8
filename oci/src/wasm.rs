//! The kvroute filter as a Wasm image that Istio (`WasmPlugin` with an `oci://` URL) and
//! Envoy Gateway pull.
//!
//! Format: the *compat* variant of the Wasm image specification that Istio implements
//! (<https://github.com/solo-io/wasm/blob/master/spec/spec-compat.md>):
//! - exactly one layer, media type `application/vnd.oci.image.layer.v1.tar+gzip`, whose tar
//!   holds one file, `plugin.wasm` (mode 0644);
//! - the manifest annotation `module.wasm.image/variant: compat` (required by the spec for
//!   that layer media type);
//! - a standard image config (`application/vnd.oci.image.config.v1+json`) with
//!   `architecture: wasm`, `os: wasip1` (Go's names for the target, as the OCI image spec uses
//!   GOARCH/GOOS values) and the layer's uncompressed digest as `rootfs.diff_ids[0]`.

use crate::{sha256_hex, write_layout, Built, OciError, TarEntry};
use oci_spec::image::{Arch, ImageConfigurationBuilder, Os};
use std::collections::HashMap;
use std::path::Path;

/// File name of the module inside the layer (compat variant).
pub const PLUGIN_FILE: &str = "plugin.wasm";
/// Manifest annotation key of the Wasm image variant.
pub const VARIANT_ANNOTATION: &str = "module.wasm.image/variant";
/// Value of [`VARIANT_ANNOTATION`].
pub const VARIANT_COMPAT: &str = "compat";

/// Write the Wasm image layout for `wasm` into `dir`, tagged `tag`. Returns the layout's
/// digests and the module's hex sha256, the value of Istio's `WasmPlugin.spec.sha256` (not
/// the manifest digest). Errors: [`OciError::NotWasm`] without the `\0asm` magic; I/O.
pub fn build_layout(wasm: &[u8], dir: &Path, tag: &str) -> Result<(Built, String), OciError> {
    if !wasm.starts_with(b"\0asm") {
        return Err(OciError::NotWasm);
    }
    let config = ImageConfigurationBuilder::default()
        .architecture(Arch::Wasm)
        .os(Os::Other("wasip1".into()))
        .build()?;
    let built = write_layout(
        dir,
        tag,
        &[TarEntry {
            path: PLUGIN_FILE,
            mode: 0o644,
            data: Some(wasm),
        }],
        config,
        Some(HashMap::from([(
            VARIANT_ANNOTATION.to_string(),
            VARIANT_COMPAT.to_string(),
        )])),
    )?;
    Ok((built, sha256_hex(wasm)))
}
