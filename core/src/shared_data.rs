//! Where the shared test data lives: real traces, prompts, metric expositions and request
//! bodies (`traces/`, `prompts/`, `metrics/`, `requests/`; provenance in that directory's
//! `README.md`). Tests, benchmarks and the tools read it in place and never copy it into the
//! repository. Not used on the request path.

use std::path::PathBuf;

/// Environment variable naming the shared-data directory (the Makefile exports it).
pub const ENV: &str = "KVROUTE_SHARED_DATA";

/// The shared-data directory: `$KVROUTE_SHARED_DATA` when set and non-empty, else
/// `../shared/data` beside the workspace root (every crate sits one level below the root,
/// so this is the same directory from any crate). The directory may not exist; readers
/// report the missing file.
pub fn dir() -> PathBuf {
    match std::env::var(ENV) {
        Ok(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data"),
    }
}
