//! Free ports and a child-process guard that kills on drop.

use std::cell::Cell;
use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A TCP port on 127.0.0.1 that was free when this returned (bind port 0, read it, close).
///
/// Another process may take it before the caller binds it; tests that need certainty bind
/// port 0 themselves (as [`super::RecordingBackend`] does).
pub fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(l.local_addr()?.port())
}

/// Resident memory of process `pid` (`VmRSS` of `/proc/<pid>/status`), bytes; `None` where
/// that file is missing or unreadable (not Linux, or the process is gone).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib * 1024)
}

/// Set to keep every file [`TempFile`] makes: the Envoy configs, admin-address files and
/// child logs of a whole run, for a post-mortem. Any value but empty, `0`, `false`, `no`,
/// `off`, `n` or `f` (any case) keeps them, as clap's falsey values read the benchmarks'
/// boolean variables.
pub const KEEP_TEMP_ENV: &str = "KVROUTE_KEEP_TEMP";

/// Whether [`KEEP_TEMP_ENV`] asks to keep the files.
fn keep_temp_set() -> bool {
    std::env::var(KEEP_TEMP_ENV).is_ok_and(|v| {
        !["", "0", "false", "no", "off", "n", "f"].contains(&v.to_ascii_lowercase().as_str())
    })
}

/// A file in the temp directory, named `kvroute-<random>-<name>` (unique across runs and
/// processes: `tempfile` creates it exclusively), removed on drop unless kept for a
/// post-mortem: when [`TempFile::keep`] was called, when the thread is panicking (a failing
/// test's drop), or when [`KEEP_TEMP_ENV`] is set. Before, every Envoy a test or the demo
/// started left its config, admin-address file and log behind (~170 KB a demo run; 96 MB of
/// them had gathered on this project's development VM).
#[derive(Debug)]
pub(crate) struct TempFile {
    /// `None` only while dropping.
    path: Option<tempfile::TempPath>,
    keep: Cell<bool>,
}

impl TempFile {
    /// Create an empty file `kvroute-<random>-<name>` in the temp directory. Errors: the
    /// temp directory is not writable.
    pub(crate) fn new(name: &str) -> std::io::Result<Self> {
        let file = tempfile::Builder::new()
            .prefix("kvroute-")
            .suffix(&format!("-{name}"))
            .tempfile()?;
        Ok(Self {
            path: Some(file.into_temp_path()),
            keep: Cell::new(false),
        })
    }

    /// The file's path (empty only while the file is being dropped).
    pub(crate) fn path(&self) -> &Path {
        self.path.as_deref().unwrap_or(Path::new(""))
    }

    /// Leave the file in place when dropped; returns its path (for a message that names it).
    pub(crate) fn keep(&self) -> &Path {
        self.keep.set(true);
        self.path()
    }
}

/// Whether [`TempFile`]s are left for a post-mortem whatever their owner says: the thread
/// is unwinding from a panic, or [`KEEP_TEMP_ENV`] is set.
fn keep_all_temp() -> bool {
    std::thread::panicking() || keep_temp_set()
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.keep.get() || keep_all_temp() {
            if let Some(p) = self.path.take() {
                // Persisting only forgets the path; the file stays as it is.
                let _ = p.keep();
            }
        }
    }
}

/// A running child process; stdout and stderr go to one log file ([`TempFile`]: removed
/// with the guard unless kept). Dropping it kills the process (SIGKILL) and reaps it.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    log: TempFile,
}

impl ChildGuard {
    /// Spawn `cmd` with its output redirected to a fresh temp log named after `name`.
    pub fn spawn(name: &str, mut cmd: Command) -> std::io::Result<Self> {
        let log = TempFile::new(&format!("{name}.log"))?;
        let out = File::create(log.path())?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()?;
        Ok(Self { child, log })
    }

    /// Path of the log file.
    pub fn log_path(&self) -> &Path {
        self.log.path()
    }

    /// Keep the log file after the guard is dropped, and return its path: for an error
    /// message that points to it.
    pub fn keep_log(&self) -> &Path {
        self.log.keep()
    }

    /// Contents of the log so far (lossy UTF-8; empty if unreadable).
    pub fn log(&self) -> String {
        std::fs::read(self.log.path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// OS process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` if the process has exited.
    pub fn try_exit(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `KVROUTE_KEEP_TEMP` in the environment keeps every file: the removals are not
    /// checked then.
    fn removals_checked() -> bool {
        let keep_all = keep_temp_set();
        if keep_all {
            eprintln!("{KEEP_TEMP_ENV} is set: removals not checked");
        }
        !keep_all
    }

    #[test]
    fn a_temp_file_goes_with_its_owner_unless_kept() {
        let gone = TempFile::new("gone.txt").unwrap();
        let gone_path = gone.path().to_path_buf();
        assert!(gone_path.is_file());
        let name = gone_path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(
            name.starts_with("kvroute-") && name.ends_with("-gone.txt"),
            "{name}"
        );
        drop(gone);
        assert!(!removals_checked() || !gone_path.exists());

        let kept = TempFile::new("kept.txt").unwrap();
        let kept_path = kept.keep().to_path_buf();
        drop(kept);
        assert!(kept_path.is_file());
        std::fs::remove_file(&kept_path).unwrap();
    }

    #[test]
    fn a_panicking_owner_leaves_its_temp_file_for_the_post_mortem() {
        let (tx, rx) = std::sync::mpsc::channel();
        let joined = std::thread::spawn(move || {
            let f = TempFile::new("panicked.log").unwrap();
            tx.send(f.path().to_path_buf()).unwrap();
            panic!("a failing test");
        })
        .join();
        assert!(joined.is_err());
        let path = rx.recv().unwrap();
        assert!(path.is_file(), "{}", path.display());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_child_guard_removes_its_log_unless_kept() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo hello"]);
        let mut child = ChildGuard::spawn("echo", cmd).unwrap();
        while child.try_exit().is_none() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(child.log(), "hello\n");
        let log = child.log_path().to_path_buf();
        drop(child);
        assert!(!removals_checked() || !log.exists());

        let child = ChildGuard::spawn("true", Command::new("true")).unwrap();
        let log = child.keep_log().to_path_buf();
        drop(child);
        assert!(log.is_file());
        std::fs::remove_file(&log).unwrap();
    }
}
