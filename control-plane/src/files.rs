//! Reading the files an operator names (config, bearer tokens, TLS material) so that no file
//! can stall or swamp the process: only regular files are read (a FIFO blocks its reader
//! until a writer opens it, and `/dev/zero` never ends), and at most a bound of bytes.
//!
//! Found by a breaker (2026-12-05): a token file swapped for a FIFO, the way Kubernetes swaps
//! a Secret's symlink, hung kvroute-cp's only worker thread (no `/healthz`, SIGTERM ignored);
//! swapped for a link to `/dev/zero`, it grew RSS by ~750 MB/s.

use std::io::Read;
use std::path::Path;

/// Largest bearer-token file read (64 KiB; a projected service-account token is ~1 KB).
pub const MAX_TOKEN_BYTES: u64 = 64 * 1024;
/// Largest TLS file read (4 MiB; a full public CA bundle is ~250 KB).
pub const MAX_TLS_BYTES: u64 = 4 * 1024 * 1024;
/// Largest config file read (16 MiB; 20,000 static endpoints take ~2 MB).
pub const MAX_CONFIG_BYTES: u64 = 16 * 1024 * 1024;

/// The bytes of the regular file at `path` (symlinks followed). Errors: the file cannot be
/// read; it is not a regular file (`InvalidInput`, "not a regular file"); it holds more than
/// `limit` bytes (`InvalidData`, "larger than N bytes").
pub fn read_regular(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind};
    // `stat` first, so a device is never opened at all (opening some has effects of its
    // own); the opened file is checked again below.
    if !std::fs::metadata(path)?.is_file() {
        return Err(not_regular());
    }
    let f = open_regular(path)?;
    let mut out = Vec::new();
    f.take(limit.saturating_add(1)).read_to_end(&mut out)?;
    if out.len() as u64 > limit {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("larger than {limit} bytes"),
        ));
    }
    Ok(out)
}

/// Open `path` for reading without blocking, and keep it only if the opened file is a
/// regular one. A FIFO swapped in after [`read_regular`]'s `stat` would otherwise hold a
/// blocking open until a writer came (found by a re-test, 2026-12-05: a loop swapping a
/// token file between a regular file and a FIFO hung the process for good). On a regular
/// file the flag changes nothing.
fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(not_regular());
    }
    Ok(f)
}

fn not_regular() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file")
}

/// [`read_regular`] as UTF-8 text (`InvalidData` when it is not).
pub fn read_regular_text(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read_regular(path, limit)?).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "stream did not contain valid UTF-8",
        )
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_regular_files_within_the_bound_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("token");
        std::fs::write(&f, b"0123456789").unwrap();
        assert_eq!(read_regular(&f, 10).unwrap(), b"0123456789");
        assert_eq!(
            read_regular(&f, 9).unwrap_err().to_string(),
            "larger than 9 bytes"
        );
        let link = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert_eq!(
            read_regular(&link, 1 << 20).unwrap_err().to_string(),
            "not a regular file"
        );
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        // Returns at once, where opening the FIFO would wait for a writer.
        assert_eq!(
            read_regular(&fifo, 1 << 20).unwrap_err().to_string(),
            "not a regular file"
        );
        // Swapped in after the `stat`, a FIFO is opened without waiting for a writer.
        assert_eq!(
            open_regular(&fifo).unwrap_err().to_string(),
            "not a regular file"
        );
        assert_eq!(
            read_regular(dir.path(), 1 << 20).unwrap_err().to_string(),
            "not a regular file"
        );
        std::fs::write(&f, [0xff, 0xfe]).unwrap();
        assert_eq!(
            read_regular_text(&f, 10).unwrap_err().to_string(),
            "stream did not contain valid UTF-8"
        );
    }
}
