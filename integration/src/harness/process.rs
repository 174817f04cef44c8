//! Free ports and a child-process guard that kills on drop.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

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

static SEQ: AtomicU64 = AtomicU64::new(0);
/// This process's start, Unix ms, fixed at the first [`temp_path`].
static STARTED_MS: std::sync::OnceLock<u128> = std::sync::OnceLock::new();

/// A unique path in the temp directory: `kvroute-<pid>-<ms>-<seq>-<name>`, `<ms>` the
/// process's first call in Unix ms. The pid alone repeats across runs where each run has
/// its own pid namespace (a container's first processes get the same pids every run) and
/// the temp directory outlives it: a file another run left (an Envoy's admin address
/// file, which the start reads until the new Envoy writes it) must not be found.
pub(crate) fn temp_path(name: &str) -> PathBuf {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let ms = STARTED_MS.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    });
    std::env::temp_dir().join(format!("kvroute-{}-{ms}-{n}-{name}", std::process::id()))
}

/// A running child process; stdout and stderr go to one log file. Dropping it kills the
/// process (SIGKILL) and reaps it. The log file is kept for post-mortems.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    log: PathBuf,
}

impl ChildGuard {
    /// Spawn `cmd` with its output redirected to a fresh temp log named after `name`.
    pub fn spawn(name: &str, mut cmd: Command) -> std::io::Result<Self> {
        let log = temp_path(&format!("{name}.log"));
        let out = File::create(&log)?;
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
        &self.log
    }

    /// Contents of the log so far (lossy UTF-8; empty if unreadable).
    pub fn log(&self) -> String {
        std::fs::read(&self.log)
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
